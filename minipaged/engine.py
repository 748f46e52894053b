"""`LLMEngine`: add requests, step, collect outputs. The loop every front end drives.

One `step()` is the whole life cycle of lesson 03:

    scheduler.schedule()        which sequences run, how many tokens each, who is preempted
    model_runner.execute(...)   flatten, forward, last-token logits
    sampler(...)                one next token per sequence that reached its last token
    _process(...)               append tokens, check stop conditions, free finished sequences'
                                blocks, publish full blocks to the prefix cache
    trace.append(StepRecord)    what happened, for the lessons' plots

`LLM` (llm.py) loops this for offline batches; the server (server/) loops it in the background.
"""
from __future__ import annotations

import time
from typing import Iterable, Optional

import torch

from minipaged.attention import get_attention_backend
from minipaged.block_manager import BlockManager
from minipaged.config import EngineConfig
from minipaged.kv_cache import allocate_kv_cache, determine_num_blocks
from minipaged.model_runner import ModelRunner
from minipaged.models.config import parse_dtype
from minipaged.models.loader import load_model, load_tokenizer, resolve_model
from minipaged.outputs import CompletionOutput, RequestOutput
from minipaged.sampling import SamplingParams, Sampler
from minipaged.scheduler import Scheduler, SchedulerOutput
from minipaged.sequence import Sequence, SequenceStatus
from minipaged.trace import ScheduledEntry, StepRecord


class RequestError(ValueError):
    """A request that cannot be served; it fails alone and the engine keeps running."""


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


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


class LLMEngine:
    def __init__(self, config: EngineConfig):
        config.validate()
        self.config = config
        self.device = resolve_device(config.device)
        self.source = resolve_model(config.model)
        from minipaged.models.config import ModelConfig
        model_cfg = ModelConfig.from_dict(self.source.config)
        config.resolve(model_cfg.max_position_embeddings)
        self.dtype = model_cfg.torch_dtype if config.dtype == "auto" else parse_dtype(config.dtype)
        self.backend = get_attention_backend(config.attention_backend, str(self.device))
        torch.manual_seed(config.seed)
        self.model, self.model_config = load_model(self.source, self.dtype, self.device, self.backend,
                                                   max_positions=config.max_model_len, seed=config.seed)
        self.tokenizer = load_tokenizer(self.source, config.tokenizer)
        self.eos_token_ids = self._eos_ids()

        num_blocks = determine_num_blocks(config, self.model_config, self.dtype, self.device,
                                          profile=self._profile_peak_memory)
        self.num_blocks = num_blocks
        self.kv_cache = allocate_kv_cache(self.model_config, num_blocks, config.block_size,
                                          self.dtype, self.device)
        self.block_manager = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, max_num_seqs=config.max_num_seqs,
                                   max_num_batched_tokens=config.max_num_batched_tokens,
                                   enable_chunked_prefill=config.enable_chunked_prefill)
        self.model_runner = ModelRunner(self.model, self.kv_cache, self.block_manager, self.backend,
                                        self.device, max_num_seqs=config.max_num_seqs,
                                        max_model_len=config.max_model_len,
                                        enforce_eager=config.enforce_eager)
        self.sampler = Sampler(seed=config.seed, eos_token_ids=self.eos_token_ids)
        self.requests: dict[str, Sequence] = {}
        self.trace: list[StepRecord] = []
        self.stream_outputs = False  # True: step() also reports unfinished requests, with text
        self._start = time.perf_counter()
        self._step_counter = 0

    def _eos_ids(self) -> list[int]:
        ids = list(self.model_config.eos_token_id)
        tok = self.tokenizer
        if tok is not None and tok.eos_token_id is not None and tok.eos_token_id not in ids:
            ids.append(tok.eos_token_id)
        return ids

    def _profile_peak_memory(self) -> int:
        """CUDA: peak activation bytes of one forward at max_num_batched_tokens (no KV cache yet)."""
        from minipaged.attention import AttentionMetadata
        n = self.config.max_num_batched_tokens
        dev = self.device
        torch.cuda.reset_peak_memory_stats(dev)
        before = torch.cuda.memory_allocated(dev)
        bs = self.config.block_size
        blocks = -(-n // bs)
        cfg = self.model_config
        kv = torch.zeros((cfg.num_hidden_layers, 2, blocks, bs, cfg.num_key_value_heads, cfg.head_dim),
                         dtype=self.dtype, device=dev)
        meta = AttentionMetadata(
            slot_mapping=torch.arange(n, device=dev), block_tables=torch.arange(blocks, device=dev,
                                                                               dtype=torch.int32)[None],
            context_lens=torch.tensor([n], dtype=torch.int32, device=dev),
            cu_seqlens_q=torch.tensor([0, n], dtype=torch.int32, device=dev), query_lens=[n],
            context_lens_host=[n], max_query_len=n, max_context_len=n, block_size=bs)
        with torch.inference_mode():
            self.backend.prepare(meta)
            hidden = self.model(torch.zeros(n, dtype=torch.long, device=dev),
                                torch.arange(n, device=dev) % self.config.max_model_len, kv, meta)
            self.model.compute_logits(hidden[-min(n, self.config.max_num_seqs):])
        torch.cuda.synchronize(dev)
        peak = torch.cuda.max_memory_allocated(dev) - before - kv.numel() * kv.element_size()
        del kv, hidden
        torch.cuda.empty_cache()
        return peak

    # --- requests ---------------------------------------------------------------------------
    def tokenize(self, prompt: str) -> list[int]:
        if self.tokenizer is None:
            raise RequestError(f"model {self.config.model!r} has no tokenizer (dummy weights?): "
                               "pass prompts as lists of token ids")
        return self.tokenizer(prompt).input_ids

    def add_request(self, request_id: str, prompt: str | list[int],
                    sampling_params: Optional[SamplingParams] = None,
                    arrival_time: Optional[float] = None) -> Sequence:
        """Queue a request. Raises `RequestError` (and queues nothing) if it can never be served."""
        params = sampling_params or SamplingParams()
        if request_id in self.requests:
            raise RequestError(f"request id {request_id!r} is already in use")
        if isinstance(prompt, str):
            text, token_ids = prompt, self.tokenize(prompt)
        else:
            text, token_ids = None, list(prompt)
        max_len = self.config.max_model_len
        if not token_ids:
            raise RequestError("the prompt is empty; give at least one token")
        if len(token_ids) >= max_len:
            raise RequestError(
                f"request {request_id!r}: the prompt has {len(token_ids)} tokens, but max_model_len "
                f"is {max_len}, which must also leave room for at least one generated token. "
                f"Shorten the prompt to at most {max_len - 1} tokens, or raise max_model_len "
                f"(the model allows up to {self.model_config.max_position_embeddings}).")
        vocab = self.model_config.vocab_size
        bad = [t for t in token_ids if not 0 <= t < vocab]
        if bad:
            raise RequestError(f"request {request_id!r}: token ids {bad[:5]} are outside the "
                               f"vocabulary [0, {vocab})")
        seq = Sequence(request_id=request_id, prompt_token_ids=token_ids, sampling_params=params,
                       prompt=text, arrival_time=arrival_time or time.time())
        self.requests[request_id] = seq
        self.scheduler.add(seq)
        return seq

    def abort_request(self, request_id: str | Iterable[str]) -> None:
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        for rid in ids:
            seq = self.requests.pop(rid, None)
            if seq is not None and not seq.is_finished:
                self.scheduler.finish(seq, SequenceStatus.FINISHED_ABORTED)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def get_num_unfinished_requests(self) -> int:
        return len(self.scheduler.waiting) + len(self.scheduler.running)

    # --- the step ---------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        t0 = time.perf_counter()
        sched = self.scheduler.schedule()
        if sched.is_empty:
            if self.scheduler.has_unfinished():
                raise RuntimeError("the scheduler could not make progress: no sequence fits in the "
                                   "KV cache (this is a bug; the config check should prevent it)")
            return []
        logits = self.model_runner.execute(sched)
        sampling = [s.seq for s in sched.scheduled if s.samples]
        sampler_out = self.sampler(logits, sampling) if sampling else None
        outputs, finished = self._process(sched, sampling, sampler_out)
        self._record(sched, finished, t0)
        return outputs

    def _process(self, sched: SchedulerOutput, sampling: list[Sequence], sampler_out):
        now = time.time()
        for s in sched.scheduled:
            s.seq.num_computed_tokens += s.num_new_tokens
            self.block_manager.cache_full_blocks(s.seq)
        outputs: list[RequestOutput] = []
        finished: list[str] = []
        for row, seq in enumerate(sampling):
            token = sampler_out.token_ids[row]
            seq.append_token(token)
            if seq.first_token_time is None:
                seq.first_token_time = now
            if sampler_out.logprobs and sampler_out.logprobs[row] is not None:
                seq.logprobs.append(sampler_out.logprobs[row])
                seq.cumulative_logprob += sampler_out.sampled_logprobs[row]
            status = self._check_stop(seq, token)
            if status is not None:
                seq.finished_time = now
                self.scheduler.finish(seq, status)
                self.requests.pop(seq.request_id, None)
                finished.append(seq.request_id)
                outputs.append(self.make_output(seq))
            elif self.stream_outputs:
                self._detokenize(seq)
                outputs.append(self.make_output(seq))
        return outputs, finished

    def _check_stop(self, seq: Sequence, token: int) -> Optional[SequenceStatus]:
        p = seq.sampling_params
        n_out = seq.num_output_tokens
        if n_out >= p.min_tokens:
            if not p.ignore_eos and token in self.eos_token_ids:
                return SequenceStatus.FINISHED_STOPPED
            if token in p.stop_token_ids:
                seq.stop_reason = token
                return SequenceStatus.FINISHED_STOPPED
            if p.stop:
                self._detokenize(seq)
                for stop in p.stop:
                    idx = seq.output_text.find(stop)
                    if idx != -1:
                        end = idx + len(stop) if p.include_stop_str_in_output else idx
                        seq.output_text = seq.output_text[:end]
                        seq.stop_reason = stop
                        return SequenceStatus.FINISHED_STOPPED
        if p.max_tokens is not None and n_out >= p.max_tokens:
            return SequenceStatus.FINISHED_LENGTH
        if seq.num_tokens >= self.config.max_model_len:
            return SequenceStatus.FINISHED_LENGTH
        return None

    def _detokenize(self, seq: Sequence) -> None:
        if self.tokenizer is not None:
            seq.output_text = detokenize(self.tokenizer, seq.prompt_token_ids, seq.output_token_ids,
                                         seq.sampling_params.skip_special_tokens)

    def make_output(self, seq: Sequence) -> RequestOutput:
        if seq.is_finished and not isinstance(seq.stop_reason, str):  # stop strings trim text
            self._detokenize(seq)
        finish = seq.status.value if seq.is_finished else None
        completion = CompletionOutput(
            index=0, text=seq.output_text, token_ids=list(seq.output_token_ids),
            cumulative_logprob=seq.cumulative_logprob if seq.logprobs is not None else None,
            logprobs=seq.logprobs, finish_reason=finish, stop_reason=seq.stop_reason)
        return RequestOutput(
            request_id=seq.request_id, prompt=seq.prompt, prompt_token_ids=seq.prompt_token_ids,
            outputs=[completion], finished=seq.is_finished, num_cached_tokens=seq.num_cached_tokens,
            metrics={"arrival_time": seq.arrival_time, "first_token_time": seq.first_token_time,
                     "finished_time": seq.finished_time, "num_preemptions": seq.num_preemptions})

    def _record(self, sched: SchedulerOutput, finished: list[str], t0: float) -> None:
        bm = self.block_manager
        entries = [ScheduledEntry(s.seq.request_id, s.seq.seq_id,
                                  s.num_new_tokens if s.is_prefill else 0,
                                  0 if s.is_prefill else s.num_new_tokens,
                                  s.seq.num_computed_tokens - s.num_new_tokens)
                   for s in sched.scheduled]
        cached = bm.allocator.num_cached_free
        record = StepRecord(
            step=self._step_counter, start_time=t0 - self._start,
            duration=time.perf_counter() - t0, scheduled=entries,
            preempted=[s.request_id for s in sched.preempted], finished=finished,
            num_waiting=len(self.scheduler.waiting), num_running=len(self.scheduler.running),
            num_blocks_used=bm.num_blocks - bm.num_free_blocks,
            num_blocks_free=bm.num_free_blocks - cached, num_blocks_cached=cached,
            num_batched_tokens=sched.num_batched_tokens)
        if self.config.record_block_tables:
            record.usage = bm.usage()
            record.block_tables = {s.request_id: list(bm.block_tables[s.seq_id])
                                   for s in self.scheduler.running}
        self.trace.append(record)
        self._step_counter += 1
