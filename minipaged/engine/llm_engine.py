"""`LLMEngine`: add requests, step, collect outputs. The loop every front end drives.

One `step()` is the whole life cycle of lesson 03:

    scheduler.schedule()        which sequences run, how many tokens each, who is preempted
    model_runner.execute(...)   flatten, forward, last-token logits
    sampler(...)                one next token per sequence that reached its last token
    _process(...)               append tokens, check stop conditions, free finished sequences'
                                blocks, publish full blocks to the prefix cache
    trace.append(StepRecord)    what happened, for the lessons' plots

Requests with several sequences (lesson 06) add two things around the sampler: a group's prompt
is forked into its `n` samples when it samples its first token (`_split_groups`), and a beam
search decides its next beams once every live beam has its logits (`_beam_step`). Swap
preemption copies blocks to and from the CPU pool before the forward (`_swap`). None of it costs
anything while no such request is in flight.

`LLM` (llm.py) loops this for offline batches; the server (server/) loops it in the background.
"""
from __future__ import annotations

import gc
import time
from typing import Iterable, Optional

import torch

from minipaged.attention import get_attention_backend
from minipaged.engine.beam_search import BeamSearchParams, BeamSearchState
from minipaged.engine.block_manager import BlockManager
from minipaged.config import EngineConfig
from minipaged.worker.kv_cache import (allocate_cpu_cache, allocate_kv_cache, block_bytes,
                                determine_num_blocks, determine_num_cpu_blocks,
                                kv_cache_torch_dtype, swap_in_blocks, swap_out_blocks,
                                to_device)
from minipaged.worker.model_runner import ModelRunner
from minipaged.models.config import ModelConfig, parse_dtype
from minipaged.models.loader import load_model, load_tokenizer, resolve_model
from minipaged.engine.output import CompletionOutput, RequestOutput
from minipaged.sampling import SamplerOutput, SamplingParams, Sampler
from minipaged.engine.scheduler import Scheduler, SchedulerOutput
from minipaged.engine.sequence import PLACEHOLDER, Sequence, SequenceGroup, SequenceStatus
from minipaged.engine.trace import ScheduledEntry, StepRecord


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


def detokenize_incrementally(tokenizer, seq: Sequence) -> None:
    """Append the text of `seq`'s newest tokens to `seq.output_text` (vLLM's offsets).

    Decoding the whole output at every step costs O(length) per token; this decodes only a short
    window: the tokens not yet turned into text plus those of the last piece of text before them
    (so sentencepiece's leading spaces come out right). A token that ends in the middle of a
    multi-byte character ("\ufffd") waits for the next one.
    """
    ids = seq.token_ids  # prompt + output
    skip = seq.sampling_params.skip_special_tokens
    if seq.detok_read_offset < 0:  # first call: the window starts in the prompt's last tokens
        seq.detok_read_offset = seq.num_prompt_tokens
        seq.detok_prefix_offset = max(seq.num_prompt_tokens - 4, 0)
    prefix_text = tokenizer.decode(ids[seq.detok_prefix_offset:seq.detok_read_offset],
                                   skip_special_tokens=skip)
    new_text = tokenizer.decode(ids[seq.detok_prefix_offset:], skip_special_tokens=skip)
    if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
        seq.output_text += new_text[len(prefix_text):]
        seq.detok_prefix_offset, seq.detok_read_offset = seq.detok_read_offset, len(ids)


class PendingStep:
    """A step's sampled tokens on their way to the host (async scheduling).

    Row i of `tokens` is the next token of `seqs[i]`. The copy into pinned host memory starts
    at once and does not block; `host_tokens()` waits for it (and so for that step) only.
    """

    def __init__(self, seqs: list[Sequence], tokens: torch.Tensor):
        self.seqs = seqs
        self.tokens = tokens  # (num_seqs,) int64 on the device: the next step's input ids
        self.row_of = {seq.seq_id: i for i, seq in enumerate(seqs)}
        if tokens.is_cuda:
            self._host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
            self._host.copy_(tokens, non_blocking=True)
            self._ready = torch.cuda.Event()
            self._ready.record()
        else:
            self._host, self._ready = tokens, None

    def host_tokens(self) -> list[int]:
        if self._ready is not None:
            self._ready.synchronize()
        return self._host.tolist()


def freeze_gc_heap() -> None:
    """Collect once, then leave every object alive now out of all later garbage collections.

    Python's cycle collector now and then runs a full (generation 2) pass that walks every
    object the process holds: torch, Triton, transformers and the model add up to about half a
    million. On the H200's host one pass took 0.3-0.5 s and came once or twice in a 5.6 s
    benchmark run, with the GPU idle meanwhile (async scheduling keeps one step queued, not a
    third of a second). What exists once the engine is built lives as long as the engine, so
    walking it again finds nothing; vLLM freezes its heap after start-up for the same reason.
    Frozen objects are still freed by reference counting; only garbage *cycles* among them
    would stay, and a dropped engine leaves none (tests/test_engine.py checks it).
    """
    gc.collect()
    gc.freeze()


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
        model_cfg = ModelConfig.from_dict(self.source.config)
        config.resolve(model_cfg.max_position_embeddings)
        self.dtype = model_cfg.torch_dtype if config.dtype == "auto" else parse_dtype(config.dtype)
        self.backend = get_attention_backend(config.attention_backend, str(self.device))
        torch.manual_seed(config.seed)
        self.model, self.model_config = load_model(self.source, self.dtype, self.device, self.backend,
                                                   max_positions=config.max_model_len, seed=config.seed,
                                                   fused_ops=config.fused_ops)
        self.tokenizer = load_tokenizer(self.source, config.tokenizer)
        self.eos_token_ids = self._eos_ids()

        self.kv_dtype = kv_cache_torch_dtype(config.kv_cache_dtype, self.dtype)
        num_blocks = determine_num_blocks(config, self.model_config, self.kv_dtype, self.device,
                                          profile=self._profile_peak_memory)
        self.num_blocks = num_blocks
        self.kv_cache = allocate_kv_cache(
            self.model_config, num_blocks, config.block_size, self.kv_dtype, self.device,
            head_major=self.device.type == "cuda" and self.backend.name == "triton")
        self.block_manager = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching)
        # Swap preemption: a CPU pool of the same layout (lesson 06).
        self.block_bytes = block_bytes(self.model_config, config.block_size, self.kv_dtype)
        num_cpu_blocks = determine_num_cpu_blocks(config, self.block_bytes, num_blocks)
        self.cpu_cache = allocate_cpu_cache(self.kv_cache, num_cpu_blocks)
        self.block_manager.enable_swap(num_cpu_blocks)
        self.scheduler = Scheduler(self.block_manager, max_num_seqs=config.max_num_seqs,
                                   max_num_batched_tokens=config.max_num_batched_tokens,
                                   enable_chunked_prefill=config.enable_chunked_prefill,
                                   preemption_mode=config.preemption_mode)
        self.model_runner = ModelRunner(self.model, self.kv_cache, self.block_manager, self.backend,
                                        self.device, max_num_seqs=config.max_num_seqs,
                                        max_model_len=config.max_model_len,
                                        enforce_eager=config.enforce_eager)
        self.sampler = Sampler(seed=config.seed, eos_token_ids=self.eos_token_ids)
        self.async_scheduling = (self.device.type == "cuda" if config.async_scheduling is None
                                 else config.async_scheduling)
        self._pending: Optional[PendingStep] = None  # async scheduling: tokens not read yet
        self._wait_time = 0.0  # this step's wait for them (StepRecord.wait_time)
        self.requests: dict[str, Sequence] = {}  # unfinished requests: their first sequence
        self.groups: dict[str, SequenceGroup] = {}  # ... those with n > 1 or a beam search
        self.trace: list[StepRecord] = []
        self._prefix_stats = (0, 0)  # block manager's (queries, hits) at the last StepRecord
        self.stream_outputs = False  # True: step() also reports unfinished requests, with text
        self._start = time.perf_counter()
        self._step_counter = 0
        if self.device.type == "cuda":  # where a pause idles the GPU (lesson 08 measures it)
            freeze_gc_heap()

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
                         dtype=self.kv_dtype, device=dev)
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
                    sampling_params: Optional[SamplingParams | BeamSearchParams] = None,
                    arrival_time: Optional[float] = None) -> Sequence:
        """Queue a request. Raises `RequestError` (and queues nothing) if it can never be served.

        `BeamSearchParams` queue a beam search (what `LLM.beam_search` does); `SamplingParams`
        with `n > 1` queue n samples of one prompt.
        """
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
        beam = None
        if isinstance(params, BeamSearchParams):
            self._check_group_fits(request_id, params.beam_width, "beam_width",
                                   len(token_ids) + params.max_tokens, all_resident=True)
            beam = BeamSearchState(params, self.eos_token_ids, len(token_ids), max_len)
            size = params.beam_width
            params = SamplingParams(temperature=0.0, max_tokens=params.max_tokens,
                                    ignore_eos=params.ignore_eos)
        else:
            size = params.n
            if size > 1:
                self._check_group_fits(request_id, size, "n", 0, all_resident=False)
        seq = Sequence(request_id=request_id, prompt_token_ids=token_ids, sampling_params=params,
                       prompt=text, arrival_time=arrival_time or time.time())
        if size > 1 or beam is not None:
            seq.group = SequenceGroup(request_id, size, [seq], beam=beam)
            self.groups[request_id] = seq.group
            if beam is not None:
                seq.logprobs = []
        self.requests[request_id] = seq
        self.scheduler.add(seq)
        return seq

    def _check_group_fits(self, request_id: str, size: int, knob: str, max_len: int,
                          all_resident: bool) -> None:
        cfg = self.config
        if size > cfg.max_num_seqs:
            raise RequestError(f"request {request_id!r}: {knob}={size} sequences cannot run at "
                               f"once with max_num_seqs={cfg.max_num_seqs}. Lower {knob} or raise "
                               f"max_num_seqs.")
        if all_resident:  # every beam must be in the cache at once, in the worst case unshared
            need = size * self.block_manager.num_blocks_for(min(max_len, cfg.max_model_len))
            if need > self.num_blocks:
                raise RequestError(
                    f"request {request_id!r}: {knob}={size} beams of up to "
                    f"{min(max_len, cfg.max_model_len)} tokens may need {need} KV blocks at once "
                    f"(if they share nothing), but the cache has {self.num_blocks}. Lower {knob} "
                    f"or max_tokens, or give the cache more blocks.")

    def abort_request(self, request_id: str | Iterable[str]) -> None:
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        for rid in ids:
            seq = self.requests.pop(rid, None)
            group = self.groups.pop(rid, None)
            for s in group.seqs if group is not None else [seq] if seq is not None else []:
                if not s.is_finished:  # every sample / beam gives its blocks back
                    self.scheduler.finish(s, SequenceStatus.FINISHED_ABORTED)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or self._pending is not None

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    # --- the step ---------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        t0 = time.perf_counter()
        self._wait_time = 0.0
        sched = self.scheduler.schedule()
        if sched.blocks_to_swap_out or sched.blocks_to_swap_in:
            self._swap(sched)  # before the forward: freed GPU blocks may be rewritten this step
        if self.groups and sched.preempted:
            self._drop_beam_logits(sched.preempted)
        if sched.is_empty:
            if self._pending is not None or sched.preempted:
                # Nothing to run, but last step's tokens to read (async scheduling), or all it
                # could do was make room (a group that outgrew the cache).
                outputs, finished = self._resolve_pending()
                self._record(sched, finished, t0)
                return outputs
            if self.scheduler.has_unfinished():
                raise RuntimeError("the scheduler could not make progress: no sequence fits in the "
                                   "KV cache (this is a bug; the config check should prevent it)")
            return []
        # The forward is queued on the GPU; nothing below waits for it until tokens are read.
        logits = self.model_runner.execute(sched, self._pending)
        sampling = [s.seq for s in sched.scheduled if s.samples]
        for s in sched.scheduled:  # their K/V are in the cache now
            s.seq.num_computed_tokens += s.num_new_tokens
            self.block_manager.cache_full_blocks(s.seq)
        if sampling and self._can_defer(sampling):
            # Async scheduling: sample on the GPU, start copying the tokens to the host, and
            # while the GPU works, finish the *previous* step on the host (its tokens are ready).
            pending = PendingStep(sampling, self.sampler.sample(logits, sampling))
            for seq in sampling:
                self._add_placeholder(seq)
            outputs, finished = self._resolve_pending()
            # Sequences that stopped meanwhile (a token read late) need nothing from this step:
            # if none is left, there is nothing to read (has_unfinished_requests stays honest).
            if any(not s.is_finished for s in pending.seqs):
                self._pending = pending
            self._record(sched, finished, t0)
            return outputs
        outputs, finished = self._resolve_pending()  # this step needs every earlier token
        ready_beams: list[SequenceGroup] = []
        if self.groups:  # n > 1 or beam search in flight (lesson 06)
            logits, sampling, ready_beams = self._split_groups(logits, sampling)
        sampler_out = self.sampler(logits, sampling) if sampling else None
        more_outputs, more_finished = self._process(sampling, sampler_out)
        outputs += more_outputs
        finished += more_finished
        for group in ready_beams:
            outputs += self._beam_step(group, finished)
        self._record(sched, finished, t0)
        return outputs

    # --- async scheduling -------------------------------------------------------------------
    # A synchronous step ends by copying the sampled tokens to the host and waiting for them, so
    # the GPU idles while the host checks stops, schedules and prepares the next step. With async
    # scheduling the host appends a PLACEHOLDER for each sampled token, plans the next step with
    # it (the lengths are all it needs: the next step's input ids are gathered from the sampled
    # tensor on the GPU by the model runner), and reads the real tokens one step later. A
    # sequence that turns out to have stopped (EOS, stop string) has computed one token in vain;
    # its placeholder is dropped. One that reaches max_tokens is known to stop in advance.
    def _can_defer(self, sampling: list[Sequence]) -> bool:
        """Tokens can be read a step late unless something needs them (or their logprobs) now."""
        if not self.async_scheduling or self.groups:
            return False
        return not any(s.sampling_params.logprobs is not None or s.sampling_params.has_penalties
                       for s in sampling)

    def _add_placeholder(self, seq: Sequence) -> None:
        seq.append_token(PLACEHOLDER)
        seq.num_pending_tokens += 1
        p = seq.sampling_params
        if ((p.max_tokens is not None and seq.num_output_tokens >= p.max_tokens)
                or seq.num_tokens >= self.config.max_model_len):
            seq.stop_pending = True

    def _resolve_pending(self) -> tuple[list[RequestOutput], list[str]]:
        """Read the previous step's tokens and process them as a synchronous step would have."""
        pending, self._pending = self._pending, None
        if pending is None:
            return [], []
        t0 = time.perf_counter()
        tokens = pending.host_tokens()  # waits for that step only; the current one keeps running
        self._wait_time += time.perf_counter() - t0
        later = []  # placeholders added after this one (the step now running), per sequence
        for seq in pending.seqs:
            k = seq.num_pending_tokens
            later.append(k - 1)
            if k:
                del seq.token_ids[-k:], seq.output_token_ids[-k:]
            seq.num_pending_tokens = 0
        outputs, finished = self._process(pending.seqs, SamplerOutput(token_ids=tokens))
        for seq, k in zip(pending.seqs, later):
            if k > 0 and not seq.is_finished:  # it is in the running step: keep its place
                for _ in range(k):
                    seq.append_token(PLACEHOLDER)
                seq.num_pending_tokens = k
        return outputs, finished

    def _swap(self, sched: SchedulerOutput) -> None:
        swap_out_blocks(self.kv_cache, self.cpu_cache, sched.blocks_to_swap_out)
        swap_in_blocks(self.cpu_cache, self.kv_cache, sched.blocks_to_swap_in)

    # --- sequence groups: parallel sampling and beam search ---------------------------------
    def _split_groups(self, logits: torch.Tensor, sampling: list[Sequence]):
        """Fork a group's prompt into its n samples at its first sample (each child samples its
        own first token from the same logits row), and set beams' logits aside until all beams
        of their group have them. Returns (logits, sequences to sample, beam groups to step)."""
        rows: list[int] = []
        seqs: list[Sequence] = []
        ready: list[SequenceGroup] = []
        for row, seq in enumerate(sampling):
            group = seq.group
            if group is not None and group.beam is not None:
                group.beam.logits[seq.seq_id] = logits[row].clone()
                if len(group.beam.logits) == len(group.seqs):
                    ready.append(group)
                continue
            rows.append(row)
            seqs.append(seq)
            if group is not None and not group.forked:  # the prompt was prefilled once: fork it
                children = [seq.fork(i) for i in range(1, group.size)]
                self.scheduler.fork(seq, children)  # BlockManager.fork: share every block
                group.seqs += children
                rows += [row] * len(children)
                seqs += children
        if rows != list(range(logits.shape[0])):
            logits = logits[to_device(rows, logits.device, torch.long)]
        return logits, seqs, ready

    def _drop_beam_logits(self, preempted: list[Sequence]) -> None:
        """A beam preempted by recompute will compute its logits again."""
        for s in preempted:
            beam = s.group.beam if s.group is not None else None
            if beam is not None and s.status is SequenceStatus.WAITING:
                beam.logits.pop(s.seq_id, None)

    def _beam_step(self, group: SequenceGroup, finished: list[str]) -> list[RequestOutput]:
        """One beam-search step (`BeamSearchState.step`), applied to the KV cache: beams nobody
        continues are freed; a parent continued by m candidates is forked m - 1 times."""
        beams = group.seqs
        logits = torch.stack([group.beam.logits.pop(s.seq_id) for s in beams])
        chosen = group.beam.step(beams, logits)
        now = time.time()
        by_parent: dict[int, list[int]] = {}
        for j, c in enumerate(chosen):
            by_parent.setdefault(c.parent, []).append(j)
        for i, seq in enumerate(beams):
            if i not in by_parent:
                self.scheduler.finish(seq, SequenceStatus.FINISHED_ABORTED)  # dropped beam
        next_beams: list[Optional[Sequence]] = [None] * len(chosen)
        for i, js in by_parent.items():
            parent = beams[i]
            children = [parent.fork(group.num_created + k) for k in range(len(js) - 1)]
            group.num_created += len(children)
            self.scheduler.fork(parent, children)  # forks before the parent moves on
            for seq, j in zip([parent] + children, js):
                c = chosen[j]
                seq.append_token(c.token)
                seq.cumulative_logprob = c.cum_logprob
                seq.logprobs.append({c.token: c.logprob})
                next_beams[j] = seq
        root = self.requests.get(group.request_id)
        if root is not None and root.first_token_time is None:
            root.first_token_time = now
        if group.beam.done:
            if root is not None:
                root.finished_time = now
            finished.append(group.request_id)
            out = self.make_group_output(group)
            self.requests.pop(group.request_id, None)
            self.groups.pop(group.request_id, None)
            group.seqs = []
            return [out]
        group.seqs = next_beams
        return [self.make_group_output(group)] if self.stream_outputs else []

    def _process(self, sampling: list[Sequence], sampler_out):
        now = time.time()
        outputs: list[RequestOutput] = []
        finished: list[str] = []
        touched: dict[str, SequenceGroup] = {}  # groups with a sample this step
        for row, seq in enumerate(sampling):
            if seq.is_finished:  # aborted, or stopped by a token read late (async scheduling)
                continue
            token = sampler_out.token_ids[row]
            seq.append_token(token)
            if seq.first_token_time is None:
                seq.first_token_time = now
            if sampler_out.logprobs and sampler_out.logprobs[row] is not None:
                seq.logprobs.append(sampler_out.logprobs[row])
                seq.cumulative_logprob += sampler_out.sampled_logprobs[row]
            status = self._check_stop(seq, token)
            if seq.group is not None:  # one of n samples: the request ends with its last sample
                if status is not None:
                    seq.finished_time = now
                    self.scheduler.finish(seq, status)
                touched[seq.request_id] = seq.group
            elif status is not None:
                seq.finished_time = now
                self.scheduler.finish(seq, status)
                self.requests.pop(seq.request_id, None)
                finished.append(seq.request_id)
                outputs.append(self.make_output(seq))
            elif self.stream_outputs:
                self._detokenize(seq)
                outputs.append(self.make_output(seq))
        for rid, group in touched.items():
            if group.is_finished:
                self.requests.pop(rid, None)
                self.groups.pop(rid, None)
                finished.append(rid)
                outputs.append(self.make_group_output(group))
            elif self.stream_outputs:
                outputs.append(self.make_group_output(group))
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
        """Bring `seq.output_text` up to date while it runs (streaming, stop strings)."""
        if self.tokenizer is not None:
            detokenize_incrementally(self.tokenizer, seq)

    def _completion(self, seq: Sequence) -> CompletionOutput:
        if (seq.is_finished and not isinstance(seq.stop_reason, str)  # stop strings trim text
                and self.tokenizer is not None):  # the final text, decoded in one go
            seq.output_text = detokenize(self.tokenizer, seq.prompt_token_ids, seq.output_token_ids,
                                         seq.sampling_params.skip_special_tokens)
        return CompletionOutput(
            index=seq.index, text=seq.output_text, token_ids=list(seq.output_token_ids),
            cumulative_logprob=seq.cumulative_logprob if seq.logprobs is not None else None,
            logprobs=seq.logprobs, finish_reason=seq.status.value if seq.is_finished else None,
            stop_reason=seq.stop_reason)

    def _request_output(self, seq: Sequence, outputs: list[CompletionOutput], finished: bool,
                        **metrics) -> RequestOutput:
        bs = self.config.block_size
        return RequestOutput(
            request_id=seq.request_id, prompt=seq.prompt, prompt_token_ids=seq.prompt_token_ids,
            outputs=outputs, finished=finished, num_cached_tokens=seq.num_cached_tokens,
            metrics={"arrival_time": seq.arrival_time, "first_token_time": seq.first_token_time,
                     "finished_time": seq.finished_time, "num_preemptions": seq.num_preemptions,
                     # prefix cache: the share of the prompt it served, in tokens and blocks
                     "prefix_cache_hit_rate": seq.num_cached_tokens / seq.num_prompt_tokens,
                     "num_cached_blocks": seq.num_cached_tokens // bs, **metrics})

    def make_output(self, seq: Sequence) -> RequestOutput:
        return self._request_output(seq, [self._completion(seq)], seq.is_finished)

    def make_group_output(self, group: SequenceGroup) -> RequestOutput:
        """n samples ordered by index; or a beam search's finished hypotheses, best first (its
        live beams while it runs)."""
        if group.beam is None:
            root = group.seqs[0]
            for s in group.seqs:
                if not s.is_finished:  # streaming: the text so far
                    self._detokenize(s)
            outputs = [self._completion(s) for s in sorted(group.seqs, key=lambda s: s.index)]
            times = [s.first_token_time for s in group.seqs if s.first_token_time is not None]
            return self._request_output(
                root, outputs, group.is_finished,
                first_token_time=min(times, default=None),
                finished_time=max((s.finished_time or 0.0 for s in group.seqs), default=None)
                if group.is_finished else None,
                num_preemptions=sum(s.num_preemptions for s in group.seqs))
        root = self.requests.get(group.request_id) or group.seqs[0]
        skip = root.sampling_params.skip_special_tokens
        if group.beam.done:
            outputs = [CompletionOutput(
                index=i, text=self._text(root, h.token_ids, skip), token_ids=h.token_ids,
                cumulative_logprob=h.cum_logprob, logprobs=h.logprobs,
                finish_reason=h.finish_reason)
                for i, h in enumerate(group.beam.results())]
        else:
            outputs = [CompletionOutput(
                index=i, text=self._text(root, s.output_token_ids, skip),
                token_ids=list(s.output_token_ids), cumulative_logprob=s.cumulative_logprob,
                logprobs=list(s.logprobs)) for i, s in enumerate(group.seqs)]
        return self._request_output(root, outputs, group.beam.done)

    def _text(self, seq: Sequence, output_ids: list[int], skip_special: bool) -> str:
        if self.tokenizer is None:
            return ""
        return detokenize(self.tokenizer, seq.prompt_token_ids, output_ids, skip_special)

    def _record(self, sched: SchedulerOutput, finished: list[str], t0: float) -> None:
        bm = self.block_manager
        grouped = bool(self.groups)  # name the samples and beams of groups ("request_id/index")
        entries = [ScheduledEntry(s.seq.request_id, s.seq.seq_id,
                                  s.num_new_tokens if s.is_prefill else 0,
                                  0 if s.is_prefill else s.num_new_tokens,
                                  s.seq.num_computed_tokens - s.num_new_tokens,
                                  s.num_cached_tokens, s.seq.name if grouped else "")
                   for s in sched.scheduled]
        cached = bm.allocator.num_cached_free
        queries, hits = self._prefix_stats
        self._prefix_stats = (bm.prefix_queries, bm.prefix_hits)
        record = StepRecord(
            step=self._step_counter, start_time=t0 - self._start,
            duration=time.perf_counter() - t0, scheduled=entries,
            preempted=list(dict.fromkeys(s.request_id for s in sched.preempted)), finished=finished,
            num_waiting=len(self.scheduler.waiting), num_running=len(self.scheduler.running),
            num_blocks_used=bm.num_blocks - bm.num_free_blocks,
            num_blocks_free=bm.num_free_blocks - cached, num_blocks_cached=cached,
            num_batched_tokens=sched.num_batched_tokens,
            num_blocks_saved_by_sharing=bm.num_blocks_saved_by_sharing,
            num_cow_copies=len(sched.blocks_to_copy),
            num_prefix_query_tokens=bm.prefix_queries - queries,
            num_prefix_hit_tokens=bm.prefix_hits - hits, wait_time=self._wait_time)
        if sched.swapped_out or sched.swapped_in:
            record.swapped_out = list(dict.fromkeys(s.request_id for s in sched.swapped_out))
            record.swapped_in = list(dict.fromkeys(s.request_id for s in sched.swapped_in))
            record.num_swapped_bytes = self.block_bytes * (len(sched.blocks_to_swap_out)
                                                           + len(sched.blocks_to_swap_in))
        if self.scheduler.num_preemptions:  # prefill work that a recompute preemption caused
            record.num_recomputed_tokens = sum(
                max(0, min(s.seq.num_computed_tokens, s.seq.recompute_until)
                    - (s.seq.num_computed_tokens - s.num_new_tokens))
                for s in sched.scheduled if s.seq.recompute_until)
        if self.config.record_block_tables:
            record.usage = bm.usage()
            record.block_tables = {s.name: list(bm.block_tables[s.seq_id])
                                   for s in self.scheduler.running}
        self.trace.append(record)
        self._step_counter += 1
