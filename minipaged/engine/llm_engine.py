"""`LLMEngine`: add requests, step, collect outputs. The loop every front end drives.

One `step()` is the whole life cycle of lesson 03:

    scheduler.schedule()        which sequences run, how many tokens each, who is preempted
    model_runner.execute(...)   flatten, forward, last-token logits
    sampler(...)                one next token per sequence that reached its last token
    _process(...)               append tokens, check stop conditions (output.py), free finished
                                sequences' blocks
    trace.append(StepRecord)    what happened, for the lessons' plots

Requests with several sequences (lesson 06) add two things around the sampler (groups.py): a
group's prompt is forked into its `n` samples when it samples its first token, and a beam search
steps once every live beam has its logits. Swap preemption copies blocks to and from the CPU
pool before the forward. None of it costs anything while no such request is in flight.

A request is checked before it is queued (processor.py), and a request that raises while it is
stepped (sampling, detokenizing, a stop check, its beam step) fails alone: `_fail` ends it with
finish_reason "error" and frees its blocks, and the step goes on for the others (failures.py).

This is the synchronous step. The GPU's fast paths are chosen once, when the engine is built
(`EngineConfig.resolve`), and live in their own rooms: the worker (`worker/`) picks its input
builder and CUDA graphs, the model its fused layers, and async scheduling
(`worker/async_scheduling.py`) replaces `step` with a loop that plans step t+1 while the GPU runs
step t. With `enable_lora` the linear layers get adapter slots when the engine is built and the
runner maps each step's tokens to them (minipaged/lora/). `LLM` (llm.py) loops `step()` for
offline batches; the server loops it in the background.
"""
from __future__ import annotations

import logging
import time
from collections import deque
from typing import Iterable, Optional

import torch

from minipaged.attention import get_attention_backend
from minipaged.config import EngineConfig
from minipaged.engine import failures, groups, processor
from minipaged.engine.beam_search import BeamSearchParams, BeamSearchState
from minipaged.engine.block_manager import BlockManager
from minipaged.engine.output import OutputProcessor, RequestOutput
from minipaged.engine.processor import RequestError
from minipaged.engine.scheduler import Scheduler, SchedulerOutput
from minipaged.engine.sequence import Sequence, SequenceGroup, SequenceStatus
from minipaged.engine.trace import StepRecord, step_record
from minipaged.lora.request import LoRARequest
from minipaged.models.config import ModelConfig, parse_dtype
from minipaged.models.loader import load_model, load_tokenizer, resolve_model
from minipaged.sampling import SamplerOutput, SamplingParams, Sampler
from minipaged.structured_output.compiling import GrammarCompiles
from minipaged.structured_output.manager import StructuredOutputManager
from minipaged.worker import make_model_runner
from minipaged.worker.cpu_threads import apply_cpu_threads
from minipaged.worker.kv_cache import (allocate_kv_cache, block_bytes, determine_num_blocks,
                                       kv_cache_torch_dtype)
from minipaged.worker.swap import (allocate_cpu_cache, determine_num_cpu_blocks, swap_in_blocks,
                                   swap_out_blocks)

logger = logging.getLogger("minipaged.engine")


class LLMEngine:
    def __init__(self, config: EngineConfig):
        self.source = resolve_model(config.model)
        model_cfg = ModelConfig.from_dict(self.source.config)
        self.config = config = config.resolve(model_cfg)  # every "auto" decided, once
        apply_cpu_threads(config.cpu_threads)  # process-wide torch state (worker/cpu_threads.py)
        self.device = torch.device(config.device)
        self.dtype = parse_dtype(config.dtype)
        self.backend = get_attention_backend(config.attention_backend, config.device)
        torch.manual_seed(config.seed)
        tp = None
        if config.tensor_parallel_size > 1:  # N processes, 1/N of every layer each (lesson 09)
            from minipaged.distributed.launch import start_tensor_parallel
            tp = start_tensor_parallel(config, self.source)  # the workers load their shards too
        self.model, self.model_config = load_model(self.source, self.dtype, self.device, self.backend,
                                                   max_positions=config.max_model_len, seed=config.seed,
                                                   fused_ops=config.fused_ops, tp=tp,
                                                   quantization=config.quantization)
        self.kv_config = self.model.config  # the KV heads this process holds: 1/N of them with TP
        self.lora_manager = None
        if config.enable_lora:  # adapter slots around the linear layers (minipaged/lora/)
            from minipaged.lora.manager import LoRAModelManager
            self.lora_manager = LoRAModelManager(
                self.model, self.model_config, max_loras=config.max_loras,
                max_lora_rank=config.max_lora_rank, max_cpu_loras=config.max_cpu_loras,
                max_num_tokens=max(config.max_num_batched_tokens, config.max_num_seqs),
                device=self.device, dtype=self.dtype, live_lora_ids=self._live_lora_ids)
        self.tokenizer = load_tokenizer(self.source, config.tokenizer)
        self.eos_token_ids = self._eos_ids()
        self.output_processor = OutputProcessor(self.tokenizer, self.eos_token_ids,
                                                config.max_model_len, config.block_size)

        # The KV cache: as many blocks as the memory knobs allow (worker/kv_cache.py).
        self.kv_dtype = kv_cache_torch_dtype(config.kv_cache_dtype, self.dtype)
        self.num_blocks = determine_num_blocks(config, self.kv_config, self.kv_dtype,
                                               self.device, profile=self._profile_peak_memory)
        self.kv_cache = allocate_kv_cache(self.kv_config, self.num_blocks, config.block_size,
                                          self.kv_dtype, self.device,
                                          head_major=config.kv_head_major)
        self.block_manager = BlockManager(self.num_blocks, config.block_size,
                                          config.enable_prefix_caching)
        # Swap preemption: a CPU pool of blocks (lesson 06, worker/swap.py).
        self.block_bytes = block_bytes(self.kv_config, config.block_size, self.kv_dtype)
        num_cpu_blocks = determine_num_cpu_blocks(config, self.block_bytes, self.num_blocks)
        self.cpu_cache = allocate_cpu_cache(self.kv_cache, num_cpu_blocks)
        self.block_manager.enable_swap(num_cpu_blocks)
        self.scheduler = self.make_scheduler(Scheduler)
        self.model_runner = make_model_runner(config, self.model, self.kv_cache, self.backend)
        if self.lora_manager is not None:  # maps each step's tokens to adapter slots first
            self.model_runner = self.lora_manager.wrap_runner(self.model_runner)
        self.sampler = Sampler(seed=config.seed, eos_token_ids=self.eos_token_ids,
                               use_kernel=config.sampler_kernel)
        # Grammar masks for requests with structured_outputs (lesson 12); idle without them.
        self.structured_output = StructuredOutputManager(
            self.tokenizer, self.model_config.vocab_size, self.eos_token_ids, config.max_num_seqs)
        self.grammar_compiles = GrammarCompiles(self.structured_output)  # ... off this thread
        self.requests: dict[str, Sequence] = {}  # unfinished requests: their first sequence
        self.groups: dict[str, SequenceGroup] = {}  # ... those with n > 1 or a beam search
        # One StepRecord per step; a bounded deque where the config caps it (a server).
        self.trace: list[StepRecord] | deque[StepRecord] = (
            [] if config.max_trace_len is None else deque(maxlen=config.max_trace_len))
        self._prefix_stats = (0, 0)  # block manager's (queries, hits) at the last StepRecord
        self._wait_time = 0.0  # this step's wait for the GPU's tokens (StepRecord.wait_time)
        self._failed_outputs: list[RequestOutput] = []  # failed before the forward (with_failed)
        self._failed_ids: list[str] = []  # ... and their ids, for the step's StepRecord
        self.stream_outputs = False  # True: step() also reports unfinished requests, with text
        self._start = time.perf_counter()
        self._step_counter = 0
        if config.async_scheduling:  # the host loop's fast path: replaces `step` (chosen once)
            from minipaged.worker.async_scheduling import AsyncScheduling
            self.async_scheduling = AsyncScheduling(self)
        self.spec_decode = None  # speculative decoding: replaces `step` (chosen once, lesson 10)
        if config.speculative_config is not None:
            from minipaged.spec_decode.engine_step import SpeculativeDecoding
            self.spec_decode = SpeculativeDecoding(self)
        if config.is_cuda:  # where a pause idles the GPU (lesson 08 measures it)
            from minipaged.worker.gpu_model_runner import freeze_gc_heap
            freeze_gc_heap()

    def make_scheduler(self, cls: type[Scheduler], **extra) -> Scheduler:
        cfg = self.config
        return cls(self.block_manager, max_num_seqs=cfg.max_num_seqs,
                   max_num_batched_tokens=cfg.max_num_batched_tokens,
                   enable_chunked_prefill=cfg.enable_chunked_prefill,
                   preemption_mode=cfg.preemption_mode,
                   max_loras=cfg.max_loras if cfg.enable_lora else 0, **extra)

    def _eos_ids(self) -> list[int]:
        ids = list(self.model_config.eos_token_id)
        tok = self.tokenizer
        if tok is not None and tok.eos_token_id is not None and tok.eos_token_id not in ids:
            ids.append(tok.eos_token_id)
        return ids

    def _profile_peak_memory(self) -> int:
        """CUDA: peak activation bytes of one forward at max_num_batched_tokens (no KV cache yet)."""
        from minipaged.worker.gpu_model_runner import profile_peak_memory
        return profile_peak_memory(self.model, self.backend, self.kv_config, self.config,
                                   self.kv_dtype, self.device)

    # --- requests ---------------------------------------------------------------------------
    def tokenize(self, prompt: str) -> list[int]:
        if self.tokenizer is None:
            raise RequestError(f"model {self.config.model!r} has no tokenizer (dummy weights?): "
                               "pass prompts as lists of token ids")
        return self.tokenizer(prompt).input_ids

    def add_request(self, request_id: str, prompt: str | list[int],
                    sampling_params: Optional[SamplingParams | BeamSearchParams] = None,
                    arrival_time: Optional[float] = None,
                    lora_request: Optional[LoRARequest] = None) -> Sequence:
        """Queue a request. Raises `RequestError` (and queues nothing) if it can never be served.

        `lora_request` runs it with that LoRA adapter (needs `enable_lora`; the adapter is read
        and checked here unless the LoRA CPU cache or a device slot already holds it).

        `BeamSearchParams` queue a beam search (what `LLM.beam_search` does); `SamplingParams`
        with `n > 1` queue n samples of one prompt.
        """
        if request_id in self.requests:
            raise RequestError(f"request id {request_id!r} is already in use")
        params = SamplingParams() if sampling_params is None else sampling_params
        vocab = self.model_config.vocab_size
        processor.validate_params(request_id, params, vocab, self.config.max_logprobs)
        if self.spec_decode is not None:  # n > 1 and beam search do not speculate yet
            from minipaged.spec_decode.request_checks import check_request
            check_request(request_id, params)
        if lora_request is not None:  # read and checked here (lora/manager.py)
            processor.check_lora(request_id, lora_request, self.lora_manager)
        text, token_ids = processor.prompt_token_ids(request_id, prompt, vocab, self.tokenize)
        max_len = self.config.max_model_len
        if len(token_ids) >= max_len:
            raise RequestError(
                f"request {request_id!r}: the prompt has {len(token_ids)} tokens, but max_model_len "
                f"is {max_len}, which must also leave room for at least one generated token. "
                f"Shorten the prompt to at most {max_len - 1} tokens, or raise max_model_len "
                f"(the model allows up to {self.model_config.max_position_embeddings}).")
        beam = None
        if isinstance(params, BeamSearchParams):
            processor.check_group_fits(request_id, params.beam_width, "beam_width",
                                       len(token_ids) + params.max_tokens, self.config,
                                       self.block_manager, all_resident=True)
            beam = BeamSearchState(params, self.eos_token_ids, len(token_ids), max_len)
            size = params.beam_width
            params = SamplingParams(temperature=0.0, max_tokens=params.max_tokens,
                                    ignore_eos=params.ignore_eos)
        else:
            size = params.n
            if size > 1:
                processor.check_group_fits(request_id, size, "n", 0, self.config,
                                           self.block_manager, all_resident=False)
        compiling = None  # the grammar's compile for this vocabulary, if it takes a while
        if getattr(params, "structured_outputs", None) is not None:  # (the last check)
            try:
                compiling = self.grammar_compiles.start(params.structured_outputs)
            except ValueError as e:
                raise RequestError(f"{e} (request {request_id!r})") from None
        seq = Sequence(request_id=request_id, prompt_token_ids=token_ids, sampling_params=params,
                       prompt=text, arrival_time=arrival_time or time.time(),
                       lora_request=lora_request)
        if size > 1 or beam is not None:
            seq.group = SequenceGroup(request_id, size, [seq], beam=beam)
            self.groups[request_id] = seq.group
            if beam is not None:
                seq.logprobs = []
        self.requests[request_id] = seq
        if compiling is None:
            self.scheduler.add(seq)
        else:  # it waits, not in the queue, until its grammar has compiled (compiling.py)
            self.grammar_compiles.hold(seq, compiling)
        return seq

    def _live_lora_ids(self) -> set[int]:
        """The adapters of the unfinished requests (the LoRA CPU cache keeps them first)."""
        return {s.lora_int_id for s in self.requests.values()} - {0}

    def abort_request(self, request_id: str | Iterable[str]) -> None:
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        for rid in ids:
            self.grammar_compiles.drop(rid)
            seq = self.requests.pop(rid, None)
            group = self.groups.pop(rid, None)
            for s in group.seqs if group is not None else [seq] if seq is not None else []:
                if not s.is_finished:  # every sample / beam gives its blocks back
                    self.scheduler.finish(s, SequenceStatus.FINISHED_ABORTED)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self.grammar_compiles.waiting)

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    # --- the step ---------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        t0 = time.perf_counter()
        sched = self._schedule()
        if sched.is_empty:
            self._check_progress(sched)
            if sched.preempted or self._failed_ids:  # all it did: make room, or fail requests
                self._record(sched, [], t0)
            return self.with_failed([])
        logits = self.model_runner.execute(sched)  # (num_sampling_seqs, vocab)
        sampling = self._computed(sched)
        outputs, finished = self._sample_and_process(logits, sampling)
        self._record(sched, finished, t0)
        return self.with_failed(outputs)

    def _schedule(self) -> SchedulerOutput:
        """Plan the step, and move swapped blocks before the forward (freed GPU blocks may be
        rewritten by this very step)."""
        if self.grammar_compiles.busy:  # those whose grammar has compiled join the queue
            self.grammar_compiles.admit(self.scheduler.add, lambda seq, exc: self._fail(
                seq, exc, self._failed_outputs, self._failed_ids),
                idle=not self.scheduler.has_unfinished())
        sched = self.scheduler.schedule()
        if self.lora_manager is not None:  # adapters the LoRA CPU cache dropped: read again
            self._fail_unreadable_adapters(sched)
        swap_out_blocks(self.kv_cache, self.cpu_cache, sched.blocks_to_swap_out)
        swap_in_blocks(self.cpu_cache, self.kv_cache, sched.blocks_to_swap_in)
        if self.groups and sched.preempted:
            groups.drop_beam_logits(sched.preempted)
        return sched

    def _fail_unreadable_adapters(self, sched: SchedulerOutput) -> None:
        """Read again the adapters of the step that the LoRA CPU cache dropped. If one's folder
        cannot be read any more, its requests fail alone before the forward (freeing their
        blocks withdraws what the step would have written from the prefix cache); their
        outputs go out with the step's (`with_failed`)."""
        failed = self.lora_manager.read_dropped({s.seq.lora_int_id for s in sched.scheduled})
        if not failed:
            return
        for s in sched.scheduled:
            if s.seq.lora_int_id in failed:
                self._fail(s.seq, failed[s.seq.lora_int_id], self._failed_outputs,
                           self._failed_ids)
        sched.scheduled = [s for s in sched.scheduled if s.seq.lora_int_id not in failed]

    def with_failed(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        """A step's outputs, after those of requests that failed before its forward."""
        if not self._failed_outputs:
            return outputs
        failed, self._failed_outputs = self._failed_outputs, []
        return failed + outputs

    def _check_progress(self, sched: SchedulerOutput) -> None:
        if not sched.preempted and not self._failed_outputs and self.scheduler.has_unfinished():
            raise RuntimeError("the scheduler could not make progress: no sequence fits in the "
                               "KV cache (this is a bug; the config check should prevent it)")

    def _computed(self, sched: SchedulerOutput) -> list[Sequence]:
        """The forward has written the step's K/V: count them computed (the full blocks they
        fill were published when the scheduler allocated their slots: now they are computed;
        `cache_full_blocks` publishes those whose tokens were not known then); returns the
        sequences that sample, in step order."""
        for s in sched.scheduled:
            s.seq.num_computed_tokens += s.num_new_tokens
            self.block_manager.cache_full_blocks(s.seq)
        return [s.seq for s in sched.scheduled if s.samples]

    def _sample_and_process(self, logits: torch.Tensor, sampling: list[Sequence]):
        outputs: list[RequestOutput] = []
        finished: list[str] = []
        ready_beams: list[SequenceGroup] = []
        if self.groups:  # n > 1 or beam search in flight (lesson 06)
            logits, sampling, ready_beams = groups.split_groups(logits, sampling, self.scheduler)
        sampler_out = None
        if sampling:
            logits = self.structured_output.apply_masks(logits, sampling)  # grammar rows only
            sampler_out, sampling, errors = self._sample(logits, sampling)
            for seq, exc in errors:
                self._fail(seq, exc, outputs, finished)
        self._process(sampling, sampler_out, outputs, finished)
        for group in ready_beams:
            try:
                outputs += self._beam_step(group, finished)
            except Exception as exc:  # this request's fault: it fails alone
                self._fail(self.requests[group.request_id], exc, outputs, finished)
        return outputs, finished

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence]):
        """Returns (the sampler's output, the sequences it holds tokens for, [(sequence, error)]
        of the rows that raised). A raise in the batch is traced to its rows (failures.py)."""
        generators = failures.save_generators(seqs)  # seeded rows: for a retry after a raise
        try:
            return self.sampler(logits, seqs), seqs, []
        except Exception:
            # Runs only after the batch raised: each row alone, so only the rows that raise fail.
            done, errors = failures.sample_rows_alone(self.sampler, logits, seqs, generators)
            return (failures.join_outputs([out for _, out in done]), [seq for seq, _ in done],
                    errors)

    def _fail(self, seq: Sequence, exc: Exception, outputs: list[RequestOutput],
              finished: list[str]) -> None:
        """End `seq`'s whole request with FINISHED_ERROR (every sample or beam), free its
        blocks, and report it in this step's `outputs` and `finished`."""
        root = self.requests.pop(seq.request_id, None)
        if root is None:  # it has already failed this step (another of its samples)
            return
        group = self.groups.pop(seq.request_id, None)
        error = failures.describe(exc)
        logger.warning("request %r failed: %s", seq.request_id, error, exc_info=exc)
        # The culprit, even if it had finished, and every other sequence still running.
        live = failures.held_seqs(self.scheduler, seq.request_id)
        for s in dict.fromkeys([seq] + live):
            self.scheduler.finish(s, SequenceStatus.FINISHED_ERROR)
            s.error = error
        root.error, root.finished_time = error, time.time()
        outputs.append(failures.error_output(self.output_processor, root, group, live))
        finished.append(seq.request_id)

    def _beam_step(self, group: SequenceGroup, finished: list[str]) -> list[RequestOutput]:
        groups.beam_step(group, self.scheduler)
        now = time.time()
        root = self.requests.get(group.request_id)
        if root is not None and root.first_token_time is None:
            root.first_token_time = now
        if not group.beam.done:
            return [self.output_processor.make_group_output(group, root)] if self.stream_outputs else []
        if root is not None:
            root.finished_time = now
        out = self.output_processor.make_group_output(group, root)
        finished.append(group.request_id)
        self.requests.pop(group.request_id, None)
        self.groups.pop(group.request_id, None)
        group.seqs = []
        return [out]

    def _process(self, sampling: list[Sequence], sampler_out: Optional[SamplerOutput],
                 outputs: list[RequestOutput], finished: list[str]) -> None:
        """Append each sampled token, check stops, finish; adds to `outputs` and `finished`.
        A raise while one request is processed fails that request alone (`_fail`)."""
        now = time.time()
        touched: dict[str, SequenceGroup] = {}  # groups with a sample this step
        out = self.output_processor
        for row, seq in enumerate(sampling):
            if seq.is_finished:  # aborted, failed, or stopped by a token read late (async)
                continue
            try:
                token = sampler_out.token_ids[row]
                seq.append_token(token)
                if seq.first_token_time is None:
                    seq.first_token_time = now
                if sampler_out.logprobs and sampler_out.logprobs[row] is not None:
                    seq.logprobs.append(sampler_out.logprobs[row])
                    seq.cumulative_logprob += sampler_out.sampled_logprobs[row]
                status = out.check_stop(seq, token)
                if status is None and seq.sampling_params.structured_outputs is not None:
                    status = self.structured_output.accept(seq)  # "stop" at the grammar's end
                if status is not None:
                    seq.finished_time = now
                    self.scheduler.finish(seq, status)
                if seq.group is not None:  # one of n samples: the request ends with its last
                    touched[seq.request_id] = seq.group
                elif status is not None:
                    outputs.append(out.make_output(seq))
                    self.requests.pop(seq.request_id, None)
                    finished.append(seq.request_id)
                elif self.stream_outputs:
                    out.detokenize(seq)
                    outputs.append(out.make_output(seq))
            except Exception as exc:  # this request's fault: it fails alone
                self._fail(seq, exc, outputs, finished)
        for rid, group in touched.items():
            if rid not in self.requests:  # it failed this step
                continue
            try:
                if group.is_finished:
                    outputs.append(out.make_group_output(group, None))
                    self.requests.pop(rid, None)
                    self.groups.pop(rid, None)
                    finished.append(rid)
                elif self.stream_outputs:
                    outputs.append(out.make_group_output(group, None))
            except Exception as exc:
                self._fail(group.seqs[0], exc, outputs, finished)

    def _record(self, sched: SchedulerOutput, finished: list[str], t0: float) -> None:
        """Append this step's StepRecord to the trace (engine/trace.py builds it)."""
        bm = self.block_manager
        finished, self._failed_ids = self._failed_ids + finished, []
        queries, hits = self._prefix_stats
        self._prefix_stats = (bm.prefix_queries, bm.prefix_hits)
        self.trace.append(step_record(self, sched, finished, t0, bm.prefix_queries - queries,
                                      bm.prefix_hits - hits))
        self._step_counter += 1
