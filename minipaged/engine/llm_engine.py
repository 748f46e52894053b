"""`LLMEngine`: add requests, step, collect outputs; `LLM` (llm.py) and the server loop `step()`.

One `step()` is the life cycle of lesson 03 in public phases, which lesson 02b calls one by one
and the step loop (step_loop.py) in order:

    schedule()            which sequences run, how many tokens each, who is preempted
    execute_model(sched)  flatten, forward, last-token logits (worker/model_runner.py)
    update_computed()     the step's K/V are in the cache
    sample_and_process()  a token per sequence that reached its last token; append it, check
                          stops (output.py), free finished sequences' blocks
    finish_step()         the step's StepRecord (trace.py) and outputs

A request is checked before it is queued (processor.py); one that raises while it is stepped
fails alone (failures.py). Later capabilities attach at build (build.py) through named seams.
"""
from __future__ import annotations

import time
from collections import deque
from typing import Iterable, Optional

import torch

from minipaged.attention import get_attention_backend
from minipaged.config import EngineConfig
from minipaged.engine import failures, processor
from minipaged.engine.build import (build_engine_scheduler, build_extensions,
                                    build_kv_block_manager, build_kv_cache, build_model,
                                    build_runner, build_sampler, settle, step_loop_class)
from minipaged.engine.output import OutputProcessor, RequestOutput, eos_token_ids
from minipaged.engine.processor import RequestError
from minipaged.engine.scheduler import SchedulerOutput
from minipaged.engine.sequence import Sequence, SequenceStatus
from minipaged.groups.group import SequenceGroup
from minipaged.engine.step_loop import StepLoop
from minipaged.engine.trace import StepRecord, StepTimes, step_record
from minipaged.groups.beam_search import BeamSearchParams
from minipaged.lora.request import LoRARequest
from minipaged.models.config import ModelConfig, parse_dtype
from minipaged.models.loader import load_tokenizer, resolve_model
from minipaged.sampling import SamplerOutput, SamplingParams
from minipaged.worker.cpu_threads import apply_cpu_threads


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
        self.requests: dict[str, Sequence] = {}  # unfinished requests: their first sequence
        self.model, self.model_config, self.lora_manager = build_model(  # (+ its transforms)
            config, self.source, self.dtype, self.device, self.backend, self.requests)
        self.kv_config = self.model.config  # the KV heads this process holds (1/N with TP)
        self.tokenizer = load_tokenizer(self.source, config.tokenizer)
        self.eos_token_ids = eos_token_ids(self.model_config, self.tokenizer)
        self.output_processor = OutputProcessor(self.tokenizer, self.eos_token_ids,
                                                config.max_model_len, config.block_size)
        self.kv_cache, self.kv_dtype, self.block_bytes = build_kv_cache(  # as many blocks as fit
            config, self.model, self.backend, self.kv_config, self.dtype, self.device)
        self.num_blocks = self.kv_cache.shape[2]  # (layers, 2, num_blocks, block_size, ...)
        self.block_manager, self.cpu_cache = build_kv_block_manager(  # (+ swap's CPU pool)
            config, self.num_blocks, self.kv_cache, self.block_bytes)
        loop_cls = step_loop_class(config)  # the step loop, chosen once (step_loop.py)
        self.scheduler = build_engine_scheduler(config, self.block_manager, loop_cls)
        self.model_runner = build_runner(config, self.model, self.kv_cache, self.backend,
                                         self.lora_manager, self.cpu_cache)
        self.sampler = build_sampler(config, self.eos_token_ids)  # (CUDA: sampling kernels)
        self.groups: dict[str, SequenceGroup] = {}  # requests of n > 1 or beams (groups/)
        self.ext, structured = build_extensions(self)  # request extensions (extensions.py)
        self.structured_output, self.grammar_compiles = structured.manager, structured.compiles
        # One StepRecord per step; a bounded deque where the config caps it (a server).
        self.trace: list[StepRecord] | deque[StepRecord] = (
            [] if config.max_trace_len is None else deque(maxlen=config.max_trace_len))
        self._prefix_stats = (0, 0)  # block manager's (queries, hits) at the last StepRecord
        self._failed_outputs: list[RequestOutput] = []  # failed before the forward (with_failed)
        self._failed_ids: list[str] = []  # ... and their ids, for the step's StepRecord
        self.stream_outputs = False  # True: step() also reports unfinished requests, with text
        self._start = time.perf_counter()
        self.num_steps = 0  # steps recorded so far (the next StepRecord's index)
        self.step_loop: StepLoop = loop_cls(self)  # built last: it may add to the runner
        settle(config)  # (CUDA: the garbage collector's heap frozen, lesson 08)

    # --- requests ---------------------------------------------------------------------------
    def tokenize(self, prompt: str) -> list[int]:
        if self.tokenizer is None:
            raise RequestError(f"model {self.config.model!r} has no tokenizer (dummy weights?): "
                               "pass prompts as lists of token ids")
        return self.tokenizer(prompt).input_ids

    def add_request(self, request_id: str, prompt: str | list[int],
                    sampling_params: Optional[SamplingParams | BeamSearchParams] = None,
                    arrival_time: Optional[float] = None,
                    lora_request: Optional[LoRARequest] = None, priority: int = 0) -> Sequence:
        """Queue a request; raises `RequestError` (and queues nothing) if it can never be served.
        `BeamSearchParams` queue a beam search, `lora_request` needs `enable_lora`, `priority`
        orders it under `scheduling_policy="priority"` (lower first)."""
        if request_id in self.requests:
            raise RequestError(f"request id {request_id!r} is already in use")
        params = SamplingParams() if sampling_params is None else sampling_params
        vocab = self.model_config.vocab_size
        processor.validate_params(request_id, params, vocab, self.config.max_logprobs)
        self.step_loop.check_request(request_id, params)  # what the loop cannot serve
        processor.check_priority(request_id, priority, self.config.scheduling_policy)
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
        created = []  # what extensions do with the new sequence (e.g. start a group of n)
        for prepare in self.ext.prepare:
            params, start = prepare(self, request_id, params, len(token_ids))
            created += [start] if start else []
        holds = [h for h in (hold(request_id, params) for hold in self.ext.hold) if h]  # last
        seq = Sequence(request_id=request_id, prompt_token_ids=token_ids, sampling_params=params,
                       prompt=text, arrival_time=arrival_time or time.time(),
                       lora_request=lora_request, priority=priority)
        for start in created:
            start(seq)
        self.requests[request_id] = seq
        if not holds:
            self.scheduler.add(seq)
        for hold in holds:  # it waits outside the queue (a grammar compiling: compiling.py)
            hold(seq)
        return seq

    def abort_request(self, request_id: str | Iterable[str]) -> None:
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        for rid in ids:
            for abort in self.ext.abort:  # e.g. a group's samples and beams are aborted
                abort(rid)
            seq = self.requests.pop(rid, None)
            if seq is not None and not seq.is_finished:  # it gives its blocks back
                self.scheduler.finish(seq, SequenceStatus.FINISHED_ABORTED)

    def has_unfinished_requests(self) -> bool:
        return self.step_loop.has_unfinished_requests()

    def has_unfinished_sequences(self) -> bool:
        """Sequences the scheduler or an extension holds (a step loop adds its own in flight)."""
        return self.scheduler.has_unfinished() or any(held() for held in self.ext.num_held)

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    # --- the step: one call of the loop's `step`, through the phases below -------------------
    def step(self) -> list[RequestOutput]:
        return self.step_loop.step()

    def schedule(self) -> SchedulerOutput:
        """Phase 1, plan the step (scheduler.py), the extensions' hooks around it."""
        for hook in self.ext.before_plan:  # e.g. held requests whose wait is over join the queue
            hook(self)
        sched = self.scheduler.schedule()
        for hook in self.ext.after_plan:  # e.g. fail what cannot run after all
            hook(self, sched)
        if sched.is_empty and (sched.blocks_to_swap_out or sched.blocks_to_swap_in):
            self.model_runner.swap(sched)  # (swap/runner.py; else the forward moves them)
        return sched

    def execute_model(self, sched: SchedulerOutput, *args) -> torch.Tensor:
        """Phase 2, the forward: logits (num_sampling_rows, vocab), queued on a GPU. `args`
        go to the runner (lesson 08: the step whose tokens are still on the device)."""
        return self.model_runner.execute(sched, *args)

    def fail_before_forward(self, seq: Sequence, exc: Exception) -> None:
        """Fail `seq`'s request alone before the step's forward (an extension found it cannot
        run); its output goes out with the step's (`with_failed`)."""
        failures.fail_request(self, seq, exc, self._failed_outputs, self._failed_ids)

    def with_failed(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        """A step's outputs, after those of requests that failed before its forward."""
        failed, self._failed_outputs = self._failed_outputs, []
        return failed + outputs

    def finish_empty_step(self, sched: SchedulerOutput, t0: float) -> list[RequestOutput]:
        """The last phase of a step that ran no forward: it is recorded only if it did
        something (made room, or failed requests before the forward)."""
        if not sched.preempted and not self._failed_outputs and self.scheduler.has_unfinished():
            raise RuntimeError("the scheduler could not make progress: no sequence fits in the "
                               "KV cache (this is a bug; the config check should prevent it)")
        if sched.preempted or self._failed_ids:
            self.record_step(sched, [], t0)
        return self.with_failed([])

    def finish_step(self, sched: SchedulerOutput, outputs: list[RequestOutput],
                    finished: list[str], t0: float, wait_time: float = 0.0) -> list[RequestOutput]:
        """The last phase: record the step (its StepRecord) and return its outputs, after
        those of requests that failed before the forward."""
        self.record_step(sched, finished, t0, wait_time)
        return self.with_failed(outputs)

    def update_computed(self, sched: SchedulerOutput) -> list[Sequence]:
        """Phase 3: the forward has written the step's K/V: count them computed, publish the
        full blocks not published at allocation; returns the sequences that sample, in order."""
        for s in sched.scheduled:
            s.seq.num_computed_tokens += s.num_new_tokens
            self.block_manager.cache_full_blocks(s.seq)
        return [s.seq for s in sched.scheduled if s.samples]

    def sample_and_process(self, logits: torch.Tensor, sampling: list[Sequence]):
        """Phase 4: sample one token per row and process them (`process_tokens`); returns
        (outputs, finished request ids). A row that raises fails its request alone."""
        outputs: list[RequestOutput] = []
        finished: list[str] = []
        for hook in self.ext.rows_to_sample:  # e.g. a prompt forks into its n samples
            logits, sampling = hook(self, logits, sampling)
        sampler_out = None
        if sampling:
            for hook in self.ext.process_logits:  # e.g. grammar masks (lesson 12)
                logits = hook(logits, sampling)
            sampler_out, sampling, errors = self.sample(logits, sampling)
            for seq, exc in errors:
                failures.fail_request(self, seq, exc, outputs, finished)
        self.process_tokens(sampling, sampler_out, outputs, finished)
        return outputs, finished

    def sample(self, logits: torch.Tensor, seqs: list[Sequence]):
        """Returns (the sampler's output, the sequences it holds tokens for, [(sequence, error)]
        of the rows that raised). A raise in the batch is traced to its rows (failures.py)."""
        return failures.sample_batch(self.sampler, logits, seqs)

    def process_tokens(self, sampling: list[Sequence], sampler_out: Optional[SamplerOutput],
                       outputs: list[RequestOutput], finished: list[str]) -> None:
        """Append each sampled token, check stops, finish; adds to `outputs` and `finished`.
        A raise while one request is processed fails that request alone."""
        now = time.time()
        out = self.output_processor
        appended: list[Sequence] = []  # the sequences that got their token
        for row, seq in enumerate(sampling):
            if seq.is_finished:  # aborted, failed, or stopped by a token read a step late
                continue
            try:
                token = sampler_out.token_ids[row]
                seq.append_token(token)
                appended.append(seq)
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
                if seq.group is not None:  # one of n samples: its group reports (after_tokens)
                    continue
                if status is not None:
                    outputs.append(out.make_output(seq))
                    self.requests.pop(seq.request_id, None)
                    finished.append(seq.request_id)
                elif self.stream_outputs:
                    out.detokenize(seq)
                    outputs.append(out.make_output(seq))
            except Exception as exc:  # this request's fault: it fails alone
                failures.fail_request(self, seq, exc, outputs, finished)
        for hook in self.ext.after_tokens:  # e.g. groups report, beam searches step
            hook(self, appended, outputs, finished)

    def record_step(self, sched: SchedulerOutput, finished: list[str], t0: float,
                    wait_time: float = 0.0) -> None:
        """Append this step's StepRecord (trace.py); `wait_time`: its wait for the GPU's tokens."""
        bm = self.block_manager
        finished, self._failed_ids = self._failed_ids + finished, []
        queries, hits = self._prefix_stats
        self._prefix_stats = (bm.prefix_queries, bm.prefix_hits)
        self.trace.append(step_record(self, sched, finished, StepTimes(
            self.num_steps, t0 - self._start, time.perf_counter() - t0, wait_time),
            bm.prefix_queries - queries, bm.prefix_hits - hits))
        self.num_steps += 1
