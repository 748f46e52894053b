"""`LLM`: the offline API, shaped like vLLM's.

    from minipaged import LLM, SamplingParams
    llm = LLM("stories260K")
    outs = llm.generate(["Once upon a time"], SamplingParams(temperature=0, max_tokens=40))
    print(outs[0].outputs[0].text)

It tokenises, queues every prompt with `LLMEngine.add_request`, calls `step()` until all are
done, and returns `RequestOutput`s in the order of the prompts. `llm.engine` exposes the engine,
its scheduler, block manager and trace for the lessons.

`SamplingParams(n=4)` returns four `CompletionOutput`s per prompt (one prefill, four samples
sharing its blocks), and `llm.beam_search(prompts, BeamSearchParams(beam_width=4, max_tokens=32))`
runs a beam search in the same engine (lesson 06).

`LLM(..., enable_lora=True, max_loras=4)` serves PEFT LoRA adapters: `generate(prompts, params,
lora_request=LoRARequest("name", 1, "path/to/adapter"))`, or a list with one per prompt (None:
the base model); different adapters run in the same batch (minipaged/lora/). `beam_search`
takes `lora_request` too, and every `RequestOutput` says which adapter it ran with.

`LLM(..., scheduling_policy="priority")` orders requests by `generate(..., priority=[...])`:
lower runs first, and a more urgent request preempts less urgent running ones (lesson 13).

Bad input is refused before anything is queued (`RequestError`, naming the prompt). A request
that fails while it runs raises `RequestError` too, once the call's other requests are aborted:
the `LLM` is left holding nothing and serves the next call as before.
"""
from __future__ import annotations

import itertools
from typing import Optional, Sequence as Seq

from tqdm.auto import tqdm

from minipaged.groups.beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence, beam_score
from minipaged.config import EngineConfig, knob_docs
from minipaged.engine.llm_engine import LLMEngine, RequestError
from minipaged.engine.output import RequestOutput
from minipaged.lora.request import LoRARequest
from minipaged.sampling import SamplingParams

PromptType = str | list[int] | dict


class LLM:
    """The offline engine, shaped like vLLM's `LLM`: `generate`, `chat`, `beam_search`.

        llm = LLM("stories260K", max_num_seqs=8, enable_prefix_caching=False)
        llm.generate(["Once upon a time"], SamplingParams(temperature=0, max_tokens=40))

    `model`: "stories260K", an HF folder or hub id, or "dummy:<preset>". Every other keyword is
    an `EngineConfig` knob (the same as the command line's flags); `llm.config` is the resolved
    config, with every automatic choice decided.
    """

    def __init__(self, model: str = "stories260K", **engine_args):
        """Build the engine: load the model, size the KV cache, pick the fast paths."""
        self.engine = LLMEngine(EngineConfig(model=model, **engine_args))
        self.config = self.engine.config  # resolved: every "auto" decided
        self._counter = itertools.count()

    def get_tokenizer(self):
        return self.engine.tokenizer

    @staticmethod
    def _normalize_prompts(prompts) -> list[PromptType]:
        if isinstance(prompts, (str, dict)):
            return [prompts]
        if not isinstance(prompts, (list, tuple)) or not prompts:
            raise RequestError(f"prompts must be a string, a list of token ids, a "
                               f"{{'prompt_token_ids': [...]}} dict, or a non-empty list of "
                               f"these, got {prompts!r:.80}")
        if not any(isinstance(p, (str, dict, list, tuple)) for p in prompts):
            return [list(prompts)]  # a single prompt given as token ids (each checked later)
        return list(prompts)

    def generate(self, prompts, sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
                 use_tqdm: bool = True,
                 lora_request: LoRARequest | Seq[LoRARequest | None] | None = None,
                 priority: Optional[Seq[int]] = None) -> list[RequestOutput]:
        """Generate for every prompt (text, token ids, or {"prompt_token_ids": [...]}).

        `lora_request`: one `LoRARequest` for every prompt, or a list of one per prompt (None:
        the base model); needs `enable_lora=True`. `priority`: one integer per prompt (lower
        runs first); needs `scheduling_policy="priority"` (vLLM's keyword)."""
        prompts = self._normalize_prompts(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = (list(sampling_params) if isinstance(sampling_params, (list, tuple))
                  else [sampling_params] * len(prompts))  # add_request checks each one
        if len(params) != len(prompts):
            raise ValueError(f"sampling_params must be one SamplingParams or a list of one per "
                             f"prompt ({len(prompts)}), got a list of {len(params)}")
        loras = self._lora_per_prompt(lora_request, len(prompts))
        if priority is not None and (not isinstance(priority, (list, tuple))
                                     or len(priority) != len(prompts)):
            raise ValueError(f"priority must be a list of one integer per prompt "
                             f"({len(prompts)}), got {priority!r:.80}")
        return self._run(self._add(prompts, params, loras, priority), use_tqdm)

    @staticmethod
    def _lora_per_prompt(lora_request, num_prompts: int) -> list[Optional[LoRARequest]]:
        loras = (list(lora_request) if isinstance(lora_request, (list, tuple))
                 else [lora_request] * num_prompts)
        if len(loras) != num_prompts:
            raise ValueError(f"lora_request must be one LoRARequest (or None) or a list of one "
                             f"per prompt ({num_prompts}), got a list of {len(loras)}")
        return loras

    def beam_search(self, prompts, params: BeamSearchParams,
                    lora_request: LoRARequest | Seq[LoRARequest | None] | None = None,
                    use_tqdm: bool = False) -> list[BeamSearchOutput]:
        """Beam search for every prompt (vLLM's API; HF's rules, see `beam_search.py`).
        `lora_request` as in `generate`: every beam runs with its prompt's adapter."""
        prompts = self._normalize_prompts(prompts)
        loras = self._lora_per_prompt(lora_request, len(prompts))
        outs = self._run(self._add(prompts, [params] * len(prompts), loras), use_tqdm)
        tok = self.engine.tokenizer
        results = []
        for out in outs:
            seqs = []
            for c in out.outputs:
                tokens = out.prompt_token_ids + c.token_ids
                seqs.append(BeamSearchSequence(
                    tokens=tokens, logprobs=c.logprobs, cum_logprob=c.cumulative_logprob,
                    text=tok.decode(tokens, skip_special_tokens=True) if tok is not None else None,
                    finish_reason=c.finish_reason,
                    stop_reason=c.token_ids[-1] if c.finish_reason == "stop" else None,
                    score=beam_score(c.cumulative_logprob, len(c.token_ids),
                                     params.length_penalty)))
            results.append(BeamSearchOutput(sequences=seqs))
        return results

    def _add(self, prompts: list[PromptType], params: list, loras: Optional[list] = None,
             priorities: Optional[Seq[int]] = None) -> list[str]:
        """Queue every prompt (validated first, so a bad one leaves the engine untouched)."""
        inputs = []
        for p in prompts:
            if isinstance(p, dict):
                p = p.get("prompt_token_ids", p.get("prompt"))
            inputs.append(p)
        ids = [f"{next(self._counter)}" for _ in inputs]
        added = []
        try:
            for i, (rid, prompt, sp, lora, prio) in enumerate(zip(
                    ids, inputs, params, loras or [None] * len(ids), priorities or [0] * len(ids))):
                try:
                    self.engine.add_request(rid, prompt, sp, lora_request=lora, priority=prio)
                except RequestError as e:
                    raise RequestError(f"prompt {i}: {e}") from None
                added.append(rid)
        except BaseException:
            self.engine.abort_request(added)
            raise
        return ids

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        """Step until every request is done. A request that fails (finish_reason "error")
        raises `RequestError` naming its prompt, once this call's other requests are aborted:
        the engine is left holding nothing, ready for the next call."""
        results: dict[str, RequestOutput] = {}
        index = {rid: i for i, rid in enumerate(ids)}
        bar = tqdm(total=len(ids), desc="Processed prompts", disable=not use_tqdm,
                   dynamic_ncols=True)
        n_out = 0
        try:
            while len(results) < len(ids):
                for out in self.engine.step():
                    if out.request_id not in index or not out.finished:
                        continue
                    if out.error is not None:
                        raise RequestError(f"prompt {index[out.request_id]} failed while it "
                                           f"was generated: {out.error}")
                    results[out.request_id] = out
                    n_out += sum(len(c.token_ids) for c in out.outputs)
                    bar.update(1)
                    bar.set_postfix_str(f"{n_out / max(bar.format_dict['elapsed'], 1e-9):.0f} tok/s")
        except BaseException:  # a failed request, an error in the model, or an interrupt
            self.engine.abort_request([rid for rid in ids if rid not in results])
            raise
        finally:
            bar.close()
        return [results[i] for i in ids]

    def chat(self, messages, sampling_params: Optional[SamplingParams] = None,
             use_tqdm: bool = True, chat_template: Optional[str] = None,
             add_generation_prompt: bool = True,
             lora_request: LoRARequest | Seq[LoRARequest | None] | None = None
             ) -> list[RequestOutput]:
        """Chat through the tokenizer's chat template (one conversation or a list of them);
        `lora_request` as in `generate`."""
        tok = self.engine.tokenizer
        if tok is None:
            raise ValueError("this model has no tokenizer, so it has no chat template")
        if chat_template is None and getattr(tok, "chat_template", None) is None:
            raise ValueError(f"the tokenizer of {self.config.model!r} has no chat template (it is "
                             "probably a base model); pass chat_template=... or use generate()")
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [tok.apply_chat_template(c, tokenize=False, chat_template=chat_template,
                                           add_generation_prompt=add_generation_prompt)
                   for c in conversations]
        # The template already holds BOS if the model wants one: tokenize without adding it again.
        token_ids = [tok(p, add_special_tokens=False).input_ids for p in prompts]
        return self.generate([{"prompt_token_ids": t} for t in token_ids], sampling_params,
                             use_tqdm, lora_request=lora_request)

    @property
    def trace(self):
        return self.engine.trace


LLM.__doc__ += "\n    Engine knobs (keyword = default: meaning):\n" + knob_docs(indent="        ")

__all__ = ["LLM"]
