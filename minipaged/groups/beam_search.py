"""Beam search: keep the `beam_width` most likely continuations, forking KV blocks every step.

    from minipaged import LLM, BeamSearchParams
    llm = LLM("stories260K")
    out = llm.beam_search(["Once upon a time"], BeamSearchParams(beam_width=4, max_tokens=20))[0]
    best = out.sequences[0]        # tokens (prompt included, as in vLLM), text, cum_logprob, score

The API is vLLM's current one (`LLM.beam_search`, `BeamSearchParams`, `BeamSearchOutput`). The
*rules* are Hugging Face's `generate(num_beams=k, do_sample=False, length_penalty=...,
early_stopping=...)` (transformers 5.x, `GenerationMixin._beam_search`), and the results are
token-exact with it (tests/test_beam_search.py). One step of a request with `k` live beams:

1. Every beam's next-token log-probabilities plus the beam's cumulative log-probability give
   `k x vocab` candidate scores; keep the best `K = 2k` (`max(2, 1 + #EOS ids) x k`, so that
   even if `k` candidates end in EOS, `k` others can go on).
2. A candidate *stops* when its token is EOS (unless `ignore_eos`) or it reaches `max_tokens`.
   The best `k` candidates that did not stop are the next step's beams.
3. Stopping candidates among the best `k` become finished hypotheses, scored
   `cum_logprob / generated_length ** length_penalty` (the generated tokens, EOS included:
   HF's rule; vLLM divides by prompt + output length without the EOS). At most `k` are kept.
4. The search ends when every candidate stopped (`max_tokens`), or `k` hypotheses are finished
   and either `early_stopping=True`, or no live beam can still beat the worst of them: HF's
   heuristic compares the best live beam's score divided by its *current* length (or, with
   `early_stopping="never"` and `length_penalty > 0`, by the longest possible length).
   The answer is the finished hypotheses, best first (live beams are not added).

Scores are float32 tensors added and divided in the same order as HF, so ties break alike.

Where it differs, on purpose:

* `beam_width=1`: HF's `generate(num_beams=1)` is greedy search, which stops at the first EOS.
  Here the beam rules still apply (2 candidates per step). With `early_stopping` True or False
  that is exactly greedy (the EOS hypothesis finishes, and the live beam, less likely at the same
  length, cannot beat it); with `early_stopping="never"` and `length_penalty > 0` the search may
  go on, because the live beam is judged at `max_tokens`
  (tests/test_beam_search.py::test_width_one_is_greedy).
* vLLM's `LLM.beam_search` scores `cum_logprob / (prompt + output length, EOS not counted)`,
  keeps every EOS hypothesis, has no early stopping and adds the live beams to the answer at
  `max_tokens`; we follow HF instead (the length is the generated tokens, EOS included), since HF
  is the reference the tests compare with token for token.
* If fewer than `beam_width` candidates go on (a vocabulary smaller than 2 x beam_width), HF keeps
  placeholder beams scored -1e9; we keep fewer beams.
* `temperature` must be 0: this is deterministic beam search (HF's `do_sample=False`).

In the engine (`llm_engine.py`, `groups.py`) the beams of one request form a `SequenceGroup`. A beam's logits wait
in `BeamSearchState.logits` until all live beams of the group have theirs (the scheduler may have
run only some of them this step); then `step()` decides, and the engine applies the decision to
the KV cache: a parent chosen by `m` candidates is forked `m - 1` times (`BlockManager.fork`: the
children share all its blocks), a beam nobody chose is freed, and the first write into a shared
partial block copies it (copy-on-write). Finished hypotheses keep only their token ids.
"""
from __future__ import annotations

import numbers
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

import torch

from minipaged.sampling import Logprob
from minipaged.validation import check_bool, check_float, check_int

if TYPE_CHECKING:  # pragma: no cover
    from minipaged.engine.sequence import Sequence


@dataclass
class BeamSearchParams:
    """vLLM's fields, plus HF's `early_stopping` (False, True or "never"; HF's default False)."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    early_stopping: bool | str = False

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Check every field (validation.py); ValueError starting with the field's name."""
        self.beam_width = check_int("beam_width", self.beam_width, lo=1)
        self.max_tokens = check_int("max_tokens", self.max_tokens, lo=1)
        self.ignore_eos = check_bool("ignore_eos", self.ignore_eos)
        if not (isinstance(self.temperature, numbers.Real)
                and not isinstance(self.temperature, bool) and self.temperature == 0):
            raise ValueError(f"temperature must be 0 for beam search (deterministic: HF's "
                             f"do_sample=False), got {self.temperature!r}; use temperature=0, or "
                             f"SamplingParams(n=...) for random samples")
        self.temperature = 0.0
        self.length_penalty = check_float("length_penalty", self.length_penalty)
        if not (isinstance(self.early_stopping, bool) or self.early_stopping == "never"):
            raise ValueError(f"early_stopping must be True, False or 'never', got "
                             f"{self.early_stopping!r}")


@dataclass
class BeamSearchSequence:
    """One result. As in vLLM, `tokens` and `text` include the prompt."""

    tokens: list[int]
    logprobs: list[dict[int, Logprob]]  # per generated token: {token: Logprob(logprob, rank)}
    cum_logprob: float = 0.0
    text: Optional[str] = None
    finish_reason: Optional[str] = None  # "stop" (EOS) or "length"
    stop_reason: Optional[int] = None
    score: float = 0.0  # cum_logprob / num_generated_tokens ** length_penalty (the ranking key)


@dataclass
class BeamSearchOutput:
    sequences: list[BeamSearchSequence]  # best first


@dataclass
class Hypothesis:
    """A finished beam: its generated tokens, nothing in the KV cache."""

    token_ids: list[int]
    logprobs: list[dict[int, Logprob]]
    cum_logprob: float
    score: float
    finish_reason: str


@dataclass
class Candidate:
    """A continuation chosen to live on: beam `parent` followed by `token`."""

    parent: int  # index into the beams passed to `step`
    token: int
    cum_logprob: float
    logprob: Logprob


@dataclass
class BeamSearchState:
    """The search state of one request; `step()` is one iteration of HF's loop."""

    params: BeamSearchParams
    eos_token_ids: list[int]
    prompt_len: int
    max_model_len: int
    finished: list[Hypothesis] = field(default_factory=list)  # best first, at most beam_width
    done: bool = False
    logits: dict[int, torch.Tensor] = field(default_factory=dict)  # seq_id -> this step's row

    @property
    def max_new_tokens(self) -> int:
        return min(self.params.max_tokens, self.max_model_len - self.prompt_len)

    def step(self, beams: list["Sequence"], logits: torch.Tensor) -> list[Candidate]:
        """`logits`: (len(beams), vocab), row i for `beams[i]`. Returns the next step's beams
        (best first) and updates `finished` and `done`."""
        p = self.params
        width = p.beam_width
        logprobs = logits.float().log_softmax(dim=-1)  # (beams, vocab)
        cum = torch.tensor([b.cumulative_logprob for b in beams], dtype=torch.float32,
                           device=logprobs.device)
        vocab = logprobs.shape[1]
        scores = (logprobs + cum[:, None]).flatten()  # (beams * vocab,)
        eos = [] if p.ignore_eos else self.eos_token_ids
        k = min(max(2, 1 + len(eos)) * width, scores.numel())
        top, idx = scores.topk(k)  # sorted, best first
        parent_t, token_t = idx // vocab, idx % vocab
        # each candidate's own log-probability and its rank among its parent's next tokens
        cand_lp = logprobs[parent_t, token_t]
        ranks = (logprobs[parent_t] > cand_lp[:, None]).sum(dim=-1) + 1
        parents, tokens = parent_t.tolist(), token_t.tolist()
        cand_lp, ranks = cand_lp.tolist(), ranks.tolist()
        gen_len = beams[0].num_output_tokens + 1  # all live beams have the same length
        at_max = gen_len >= self.max_new_tokens
        stops = [at_max or t in eos for t in tokens]

        def logprob(i: int) -> Logprob:
            return Logprob(cand_lp[i], ranks[i])

        # Finished hypotheses: the stopping candidates among the best `width`.
        norm = (top[:width] / (gen_len ** p.length_penalty)).tolist()
        top_list = top.tolist()
        for i in range(min(width, k)):
            if stops[i]:
                b = beams[parents[i]]
                self.finished.append(Hypothesis(
                    token_ids=b.output_token_ids + [tokens[i]],
                    logprobs=(b.logprobs or []) + [{tokens[i]: logprob(i)}],
                    cum_logprob=top_list[i], score=norm[i],
                    finish_reason="stop" if tokens[i] in eos else "length"))
        self.finished.sort(key=lambda h: -h.score)  # stable: earlier hypotheses win ties
        del self.finished[width:]

        # The next beams: the best `width` candidates that go on.
        live = [i for i in range(k) if not stops[i]][:width]
        full = len(self.finished) == width
        improvable = True
        if full and live:  # HF's heuristic: could the best live beam still beat the worst?
            best_len = (self.max_new_tokens if p.early_stopping == "never" and p.length_penalty > 0
                        else gen_len)
            best = top[live[0]] / (best_len ** p.length_penalty)
            improvable = float(best) > self.finished[-1].score
        self.done = not live or (full and (p.early_stopping is True or not improvable))
        if self.done:
            return []
        return [Candidate(parents[i], tokens[i], top_list[i], logprob(i)) for i in live]

    def results(self) -> list[Hypothesis]:
        return list(self.finished)


def beam_score(cum_logprob: float, num_generated: int, length_penalty: float) -> float:
    """HF's length-normalised score, computed in float32 like `step()`."""
    return float(torch.tensor(cum_logprob, dtype=torch.float32) / (num_generated ** length_penalty))
