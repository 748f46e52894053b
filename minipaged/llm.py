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
"""
from __future__ import annotations

import itertools
from typing import Optional, Sequence as Seq

from tqdm.auto import tqdm

from minipaged.engine.beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence, beam_score
from minipaged.config import EngineConfig
from minipaged.engine.llm_engine import LLMEngine, RequestError
from minipaged.engine.output import RequestOutput
from minipaged.sampling import SamplingParams

PromptType = str | list[int] | dict


class LLM:
    def __init__(self, model: str = "stories260K", **engine_args):
        """`engine_args`: any `EngineConfig` field (config.py), e.g. `max_model_len`,
        `max_num_seqs`, `block_size`, `num_blocks`, `enable_prefix_caching`, `device`."""
        self.engine = LLMEngine(EngineConfig(model=model, **engine_args))
        self.config = self.engine.config  # resolved: every "auto" decided
        self._counter = itertools.count()

    def get_tokenizer(self):
        return self.engine.tokenizer

    @staticmethod
    def _normalize_prompts(prompts) -> list[PromptType]:
        if isinstance(prompts, (str, dict)):
            return [prompts]
        prompts = list(prompts)
        if prompts and all(isinstance(t, int) for t in prompts):
            return [prompts]  # a single prompt given as token ids
        return prompts

    def generate(self, prompts, sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Generate for every prompt (text, token ids, or {"prompt_token_ids": [...]})."""
        prompts = self._normalize_prompts(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = ([sampling_params] * len(prompts) if isinstance(sampling_params, SamplingParams)
                  else list(sampling_params))
        if len(params) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(params)} sampling params")
        return self._run(self._add(prompts, params), use_tqdm)

    def beam_search(self, prompts, params: BeamSearchParams,
                    use_tqdm: bool = False) -> list[BeamSearchOutput]:
        """Beam search for every prompt (vLLM's API; HF's rules, see `beam_search.py`)."""
        prompts = self._normalize_prompts(prompts)
        outs = self._run(self._add(prompts, [params] * len(prompts)), use_tqdm)
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

    def _add(self, prompts: list[PromptType], params: list) -> list[str]:
        """Queue every prompt (validated first, so a bad one leaves the engine untouched)."""
        inputs = []
        for p in prompts:
            if isinstance(p, dict):
                p = p.get("prompt_token_ids", p.get("prompt"))
            inputs.append(p)
        ids = [f"{next(self._counter)}" for _ in inputs]
        added = []
        try:
            for rid, prompt, sp in zip(ids, inputs, params):
                self.engine.add_request(rid, prompt, sp)
                added.append(rid)
        except RequestError:
            self.engine.abort_request(added)
            raise
        return ids

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        results: dict[str, RequestOutput] = {}
        wanted = set(ids)
        bar = tqdm(total=len(ids), desc="Processed prompts", disable=not use_tqdm,
                   dynamic_ncols=True)
        n_out = 0
        try:
            while len(results) < len(ids):
                for out in self.engine.step():
                    if out.finished and out.request_id in wanted:
                        results[out.request_id] = out
                        n_out += sum(len(c.token_ids) for c in out.outputs)
                        bar.update(1)
                        bar.set_postfix_str(f"{n_out / max(bar.format_dict['elapsed'], 1e-9):.0f} tok/s")
        finally:
            bar.close()
        return [results[i] for i in ids]

    def chat(self, messages, sampling_params: Optional[SamplingParams] = None,
             use_tqdm: bool = True, chat_template: Optional[str] = None,
             add_generation_prompt: bool = True) -> list[RequestOutput]:
        """Chat through the tokenizer's chat template (one conversation or a list of them)."""
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
        return self.generate([{"prompt_token_ids": t} for t in token_ids], sampling_params, use_tqdm)

    @property
    def trace(self):
        return self.engine.trace


__all__ = ["LLM"]
