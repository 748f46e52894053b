"""After the sampler: stop checks, detokenizing, and vLLM-shaped results (lessons 03, 04, 06).

`OutputProcessor` (vLLM V1's name) is what the engine calls once a sequence has its new token:

    check_stop(seq, token)   EOS, a stop token, a stop string, max_tokens, max_model_len
    detokenize(seq)          bring `seq.output_text` up to date (streaming, stop strings)
    make_output(seq)         a `RequestOutput` holding one `CompletionOutput` per sample, and
                             the request's `LoRARequest` (None: the base model), as vLLM's

Text is decoded incrementally while a request runs (tokenizers' `DecodeStream`) and
once, whole, when it finishes.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

from tokenizers.decoders import DecodeStream

from minipaged.engine.sequence import Sequence, SequenceStatus
from minipaged.groups.group import SequenceGroup
from minipaged.lora.request import LoRARequest
from minipaged.sampling import Logprob

if TYPE_CHECKING:  # pragma: no cover
    from minipaged.groups.beam_search import BeamSearchState


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: Optional[float]
    logprobs: Optional[list[dict[int, Logprob]]]
    finish_reason: Optional[str] = None  # "stop" | "length" | "abort" | "error" | None: running
    stop_reason: Optional[int | str] = None  # the stop string or stop token that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    metrics: dict = field(default_factory=dict)  # arrival / first token / finished times
    error: Optional[str] = None  # set when the request ended with finish_reason "error"
    lora_request: Optional[LoRARequest] = None  # the adapter it ran with (None: the base model)
    # SamplingParams.prompt_logprobs: per prompt token {token id: Logprob}, None at position 0
    prompt_logprobs: Optional[list[Optional[dict[int, Logprob]]]] = None


def detokenize(tokenizer, prompt_ids: list[int], output_ids: list[int], skip_special: bool) -> str:
    """Text of `output_ids` as it reads *after* the prompt.

    Decoding the output alone would lose the leading space that sentencepiece folds into the
    first token ("Lily" + "▁went" would decode to "went"), so decode a few prompt tokens with it
    and cut their text off again.
    """
    context = prompt_ids[-4:]
    head = tokenizer.decode(context, skip_special_tokens=skip_special)
    full = tokenizer.decode(context + output_ids, skip_special_tokens=skip_special)
    if full.startswith(head):
        return full[len(head):]
    return tokenizer.decode(output_ids, skip_special_tokens=skip_special)


def detokenize_incrementally(tokenizer, seq: Sequence) -> None:
    """Append the text of `seq`'s newest tokens to `seq.output_text`.

    Decoding the whole output at every step costs O(length) per token; tokenizers' `DecodeStream`
    decodes only what is new, with the tokens before it as context (so sentencepiece's leading
    spaces come out right), and holds back a token that ends in the middle of a multi-byte
    character until the next one completes it. A forked sequence starts its own stream from the
    tokens whose text it already has.
    """
    if seq.detok_stream is None:
        if seq.detok_read_offset < 0:
            seq.detok_read_offset = seq.num_prompt_tokens
        seq.detok_stream = DecodeStream(ids=seq.token_ids[:seq.detok_read_offset],
                                        skip_special_tokens=seq.sampling_params.skip_special_tokens)
    new = seq.token_ids[seq.detok_read_offset:]
    if new:
        chunk = seq.detok_stream.step(tokenizer.backend_tokenizer, new)
        seq.detok_read_offset = seq.num_tokens
        if chunk:
            seq.output_text += chunk


def find_stop_string(text: str, searched: int, stops: list[str],
                     include: bool) -> Optional[tuple[str, int]]:
    """The stop string that ends in the new text `text[searched:]` and starts first, with the
    length the text is cut to (its end if `include`, else its start); None if there is none.

    Only matches that reach into the new text count (vLLM's window: the last `len(stop) - 1`
    old characters plus the new ones), so text that was checked before, or produced before
    min_tokens, is never cut after the fact, and the search costs O(new text) per step.
    """
    best: Optional[tuple[str, int]] = None
    for stop in stops:
        idx = text.find(stop, max(searched - len(stop) + 1, 0))
        if idx != -1 and (best is None or idx < best[1]):
            best = (stop, idx)
    if best is None:
        return None
    stop, idx = best
    return stop, idx + len(stop) if include else idx


def eos_token_ids(model_config, tokenizer) -> list[int]:
    """The model's end-of-sequence ids, and the tokenizer's if it names another."""
    ids = list(model_config.eos_token_id)
    if tokenizer is not None and tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in ids:
        ids.append(tokenizer.eos_token_id)
    return ids


class OutputProcessor:
    def __init__(self, tokenizer, eos_token_ids: list[int], max_model_len: int, block_size: int):
        self.tokenizer = tokenizer  # None for dummy weights: outputs carry token ids only
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.block_size = block_size

    def check_stop(self, seq: Sequence, token: int) -> Optional[SequenceStatus]:
        """The finished status `seq` reaches with its newest `token`, or None to go on."""
        p = seq.sampling_params
        n_out = seq.num_output_tokens
        if n_out >= p.min_tokens:
            if not p.ignore_eos and token in self.eos_token_ids:
                return SequenceStatus.FINISHED_STOPPED
            if token in p.stop_token_ids:
                seq.stop_reason = token
                return SequenceStatus.FINISHED_STOPPED
        if p.stop and self.check_stop_strings(seq):
            return SequenceStatus.FINISHED_STOPPED
        if p.max_tokens is not None and n_out >= p.max_tokens:
            return SequenceStatus.FINISHED_LENGTH
        if seq.num_tokens >= self.max_model_len:
            return SequenceStatus.FINISHED_LENGTH
        return None

    def check_stop_strings(self, seq: Sequence) -> bool:
        """Detokenize `seq`'s new tokens and look for a stop string in the new text only, once
        min_tokens are out. On a match: cut the text there, set `stop_reason`, return True."""
        p = seq.sampling_params
        self.detokenize(seq)
        found = None
        if seq.num_output_tokens >= p.min_tokens:
            found = find_stop_string(seq.output_text, seq.stop_searched_len, p.stop,
                                     p.include_stop_str_in_output)
        seq.stop_searched_len = len(seq.output_text)
        if found is None:
            return False
        seq.stop_reason, end = found
        seq.output_text = seq.output_text[:end]
        return True

    def detokenize(self, seq: Sequence) -> None:
        """Bring `seq.output_text` up to date while it runs (streaming, stop strings)."""
        if self.tokenizer is not None and seq.sampling_params.detokenize:
            detokenize_incrementally(self.tokenizer, seq)

    def final_text(self, seq: Sequence) -> None:
        """The finished text, decoded in one go. If it streamed, that text extends what was
        streamed (a trailing partial character the stream held back, if any); in the odd case
        where a tokenizer's whole decode disagrees with its stream, the streamed text stays, so
        a streamed response and its final text always agree."""
        full = self.text(seq, seq.output_token_ids, seq.sampling_params.skip_special_tokens)
        if seq.detok_read_offset < 0 or full.startswith(seq.output_text):
            seq.output_text = full

    def text(self, seq: Sequence, output_ids: list[int], skip_special: bool) -> str:
        if self.tokenizer is None:
            return ""
        return detokenize(self.tokenizer, seq.prompt_token_ids, output_ids, skip_special)

    def completion(self, seq: Sequence) -> CompletionOutput:
        if (seq.is_finished and not isinstance(seq.stop_reason, str)  # stop strings trim text
                and self.tokenizer is not None and seq.sampling_params.detokenize):
            self.final_text(seq)
        return CompletionOutput(
            index=seq.index, text=seq.output_text, token_ids=list(seq.output_token_ids),
            cumulative_logprob=seq.cumulative_logprob if seq.logprobs is not None else None,
            logprobs=seq.logprobs, finish_reason=seq.status.value if seq.is_finished else None,
            stop_reason=seq.stop_reason)

    def request_output(self, seq: Sequence, outputs: list[CompletionOutput], finished: bool,
                       **metrics) -> RequestOutput:
        return RequestOutput(
            request_id=seq.request_id, prompt=seq.prompt, prompt_token_ids=seq.prompt_token_ids,
            outputs=outputs, finished=finished, num_cached_tokens=seq.num_cached_tokens,
            error=seq.error, lora_request=seq.lora_request, prompt_logprobs=seq.prompt_logprobs,
            metrics={"arrival_time": seq.arrival_time, "first_token_time": seq.first_token_time,
                     "finished_time": seq.finished_time, "num_preemptions": seq.num_preemptions,
                     # prefix cache: the share of the prompt it served, in tokens and blocks
                     "prefix_cache_hit_rate": seq.num_cached_tokens / seq.num_prompt_tokens,
                     "num_cached_blocks": seq.num_cached_tokens // self.block_size,
                     # speculative decoding: tokens proposed for it, and accepted (lesson 10)
                     "spec_num_draft_tokens": seq.num_draft_tokens,
                     "spec_num_accepted_tokens": seq.num_accepted_tokens, **metrics})

    def make_output(self, seq: Sequence) -> RequestOutput:
        return self.request_output(seq, [self.completion(seq)], seq.is_finished)

    def make_group_output(self, group: SequenceGroup, root: Optional[Sequence]) -> RequestOutput:
        """n samples ordered by index; or a beam search's finished hypotheses, best first (its
        live beams while it runs). `root`: the request's first sequence."""
        if group.beam is None:
            for s in group.seqs:
                if not s.is_finished:  # streaming: the text so far
                    self.detokenize(s)
            outputs = [self.completion(s) for s in sorted(group.seqs, key=lambda s: s.index)]
            times = [s.first_token_time for s in group.seqs if s.first_token_time is not None]
            return self.request_output(
                group.seqs[0], outputs, group.is_finished,
                first_token_time=min(times, default=None),
                finished_time=max((s.finished_time or 0.0 for s in group.seqs), default=None)
                if group.is_finished else None,
                num_preemptions=sum(s.num_preemptions for s in group.seqs))
        root = root or group.seqs[0]
        return self.request_output(root, self._beam_outputs(group.beam, group.seqs, root),
                                   group.beam.done)

    def _beam_outputs(self, beam: "BeamSearchState", beams: list[Sequence],
                      root: Sequence) -> list[CompletionOutput]:
        skip = root.sampling_params.skip_special_tokens
        if beam.done:
            return [CompletionOutput(
                index=i, text=self.text(root, h.token_ids, skip), token_ids=h.token_ids,
                cumulative_logprob=h.cum_logprob, logprobs=h.logprobs,
                finish_reason=h.finish_reason)
                for i, h in enumerate(beam.results())]
        return [CompletionOutput(
            index=i, text=self.text(root, s.output_token_ids, skip),
            token_ids=list(s.output_token_ids), cumulative_logprob=s.cumulative_logprob,
            logprobs=list(s.logprobs)) for i, s in enumerate(beams)]
