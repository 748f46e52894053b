"""Where KV-cache memory goes: contiguous reservation beside paging (the vLLM paper's Fig. 2).

Lesson 01 (`notebooks/01_kv_memory_waste.ipynb`) is built on this file; `tests/test_memory_waste.py`
checks its accounting by hand on tiny traces.

One request trace (prompt and output lengths) is served by five memory strategies, step by step,
in a KV cache of the same size (counted in *slots*: one slot holds one token's K and V in every
layer):

* contiguous, each request gets one contiguous region when admitted (first fit), kept until it
  finishes; the size of the region is the strategy, as in the paper's Orca variants:
  - ``max``    max_model_len slots (Orca (Max): the output length is unknown, plan for the worst);
  - ``pow2``   the next power of two of the request's true length (Orca (Pow2));
  - ``oracle`` exactly the true length (Orca (Oracle): an allocator that knows the future);
* ``paged``  minipaged's *real* `Scheduler` and `BlockManager` (not a formula): the trace is fed
  to them and `block_usage` (engine/block_usage.py) is read after every step, exactly where
  `LLMEngine` records its `StepRecord.usage`. Only the model forward is skipped, because memory
  does not depend on it.

A request with a prompt of p tokens that generates o tokens writes ``p + o - 1`` K/V entries over
its life (the last sampled token is returned, never fed back); that is its *true length* here.

After every step each slot of the cache falls in exactly one category (they sum to the cache):

=========================  =====================================================================
token states               slots holding a K/V entry that has been computed
reserved                   slots a request holds for K/V it will write later (contiguous only)
internal fragmentation     slots a request holds that it will never fill: ``region - true
                           length`` for contiguous; the empty tail of partly filled blocks for
                           paged (`BlockUsage.internal_fragmentation`)
external fragmentation     free slots while the request at the head of the queue cannot be
                           admitted although the free slots add up to its region: they lie in
                           holes that are each too small. Zero for paging by construction (any
                           free block serves any request).
free                       every other unused slot
=========================  =====================================================================

The **token-state share** (the paper's headline number) is time-averaged as a ratio of sums:

    share = sum over steps of token states / sum over steps of (token states + reserved
            + internal + external fragmentation)

i.e. the fraction of the KV memory that is *taken* (held by requests or lost to fragmentation)
that holds real token states, weighting every step by how much memory it takes. Free slots are
left out of the denominator: an idle cache at the end of a run is not waste of the strategy. For
paged it is exactly ``sum(num_tokens_stored) / sum(num_slots_allocated)`` from `BlockUsage`.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Iterable, Optional, Sequence as Seq

from minipaged.engine.block_usage import block_usage
from minipaged.simulator.admission import ContiguousAllocator, next_pow2
from minipaged.simulator.admission import reservation as contiguous_reservation

CATEGORIES = ("token_states", "reserved", "internal_fragmentation", "external_fragmentation",
              "free")
CATEGORY_LABELS = {"token_states": "token states", "reserved": "reserved",
                   "internal_fragmentation": "internal frag.",
                   "external_fragmentation": "external frag.", "free": "free"}
CONTIGUOUS_STRATEGIES = ("max", "pow2", "oracle")
STRATEGY_LABELS = {"max": "Orca (Max)", "pow2": "Orca (Pow2)", "oracle": "Orca (Oracle)"}

# The paper's own Fig. 2 (Kwon et al., SOSP 2023): share of KV memory holding token states.
PAPER_TOKEN_STATE_SHARE = {"Orca (Max)": 0.204, "Orca (Pow2)": 0.268, "Orca (Oracle)": 0.382,
                           "vLLM": 0.963}


@dataclass(frozen=True)
class Request:
    prompt_len: int
    output_len: int

    @property
    def kv_len(self) -> int:
        """K/V entries the request writes over its life: prompt + output - 1."""
        return self.prompt_len + self.output_len - 1


def requests_from(workload) -> list[Request]:
    """`Request`s from a `minipaged.lessons.bench.Workload` or an iterable of (prompt_len, output_len)."""
    if hasattr(workload, "prompts"):
        return [Request(len(p), m) for p, m in zip(workload.prompts, workload.max_tokens)]
    return [r if isinstance(r, Request) else Request(int(r[0]), int(r[1])) for r in workload]


@dataclass
class WasteStep:
    """One step's accounting, in slots; the five categories sum to the cache size."""

    step: int
    token_states: int
    reserved: int
    internal_fragmentation: int
    external_fragmentation: int
    free: int
    num_running: int
    num_waiting: int

    @property
    def total(self) -> int:
        return sum(getattr(self, c) for c in CATEGORIES)

    @property
    def taken(self) -> int:
        return self.total - self.free


@dataclass
class WasteResult:
    """A whole run of one strategy on one trace."""

    strategy: str
    capacity: int  # slots in the cache
    steps: list[WasteStep]
    block_size: Optional[int] = None  # paged only
    num_preemptions: int = 0
    extra: dict = field(default_factory=dict)

    @property
    def label(self) -> str:
        if self.strategy == "paged":
            return f"paged (block {self.block_size})"
        return STRATEGY_LABELS.get(self.strategy, self.strategy)

    def totals(self) -> dict[str, int]:
        """Slot-steps per category, summed over the run."""
        return {c: sum(getattr(s, c) for s in self.steps) for c in CATEGORIES}

    def shares(self, include_free: bool = False) -> dict[str, float]:
        """Time-averaged share of each category: of the taken memory (default) or of the cache."""
        t = self.totals()
        cats = CATEGORIES if include_free else CATEGORIES[:-1]
        denom = sum(t[c] for c in cats)
        return {c: (t[c] / denom if denom else 0.0) for c in cats}

    @property
    def token_state_share(self) -> float:
        return self.shares()["token_states"]

    @property
    def num_steps(self) -> int:
        return len(self.steps)

    @property
    def mean_running(self) -> float:
        """Average batch size: how many requests the memory let run at once."""
        return sum(s.num_running for s in self.steps) / max(len(self.steps), 1)

    def summary(self) -> dict:
        sh = self.shares()
        return {"strategy": self.label, "token_states": sh["token_states"],
                "reserved": sh["reserved"], "internal": sh["internal_fragmentation"],
                "external": sh["external_fragmentation"], "steps": self.num_steps,
                "mean_running": self.mean_running, "preemptions": self.num_preemptions}


# --- contiguous allocation ------------------------------------------------------------------
def reservation(strategy: str, request: Request, max_model_len: int) -> int:
    """Slots a contiguous strategy reserves for `request` when it is admitted (the rule and the
    allocator are the simulator's, minipaged/simulator/admission.py, lesson 13)."""
    return contiguous_reservation(strategy, request.kv_len, max_model_len)


@dataclass
class _Live:
    idx: int
    req: Request
    region: int
    computed: int = 0  # K/V entries written
    generated: int = 0  # tokens sampled

    @property
    def known(self) -> int:  # prompt + sampled tokens
        return self.req.prompt_len + self.generated


def simulate_contiguous(requests: Iterable, strategy: str, capacity: int, *,
                        max_model_len: int = 2048, max_num_seqs: int = 256,
                        max_num_batched_tokens: int = 2048) -> WasteResult:
    """Serve `requests` (all arriving at step 0) with contiguous per-request regions.

    Iteration-level scheduling like minipaged's `Scheduler` (decodes first, then prefill chunks,
    then FIFO admission under the same token budget and seat limit), so only the memory policy
    differs from the paged run. A region covers the request's whole life, so nothing is ever
    preempted; a request waits until a hole big enough for its region appears.
    """
    reqs = requests_from(requests)
    for r in reqs:
        if r.kv_len + 1 > max_model_len or r.prompt_len < 1 or r.output_len < 1:
            raise ValueError(f"{r} does not fit max_model_len={max_model_len}")
        if reservation(strategy, r, max_model_len) > capacity:
            raise ValueError(f"a {strategy} region for {r} is larger than the cache ({capacity})")
    alloc = ContiguousAllocator(capacity)
    waiting = deque(range(len(reqs)))
    running: list[_Live] = []
    steps: list[WasteStep] = []
    while waiting or running:
        budget = max_num_batched_tokens
        finished: list[_Live] = []
        decodes = [x for x in running if x.known - x.computed == 1]
        chunks = [x for x in running if x.known - x.computed > 1]
        for x in decodes + chunks:
            if budget == 0:
                break
            n = min(x.known - x.computed, budget)
            budget -= n
            _advance(x, n, finished)
        while waiting and budget > 0 and len(running) < max_num_seqs:
            r = reqs[waiting[0]]
            size = reservation(strategy, r, max_model_len)
            if alloc.allocate(waiting[0], size) is None:
                break
            x = _Live(waiting.popleft(), r, size)
            running.append(x)
            n = min(r.prompt_len, budget)
            budget -= n
            _advance(x, n, finished)
        if not finished and budget == max_num_batched_tokens:
            raise RuntimeError("no progress: the cache cannot hold the next request")
        for x in finished:
            running.remove(x)
            alloc.free(x.idx)
        steps.append(_contiguous_step(len(steps), running, waiting, reqs, alloc, strategy,
                                      max_model_len, max_num_seqs))
    return WasteResult(strategy, capacity, steps)


def _advance(x: _Live, n: int, finished: list) -> None:
    """Compute `n` tokens; sample one if that reaches the end of the known tokens."""
    x.computed += n
    if x.computed == x.known:
        x.generated += 1
        if x.generated == x.req.output_len:
            finished.append(x)


def _contiguous_step(step, running, waiting, reqs, alloc, strategy, max_model_len, max_num_seqs):
    tokens = sum(x.computed for x in running)
    reserved = sum(x.req.kv_len - x.computed for x in running)
    internal = sum(x.region - x.req.kv_len for x in running)
    free = alloc.free_slots
    external = 0
    if waiting and len(running) < max_num_seqs:
        need = reservation(strategy, reqs[waiting[0]], max_model_len)
        if alloc.largest_hole < need <= free:  # enough in total, but not in one piece
            external = free
    return WasteStep(step, tokens, reserved, internal, external, free - external,
                     len(running), len(waiting))


# --- paged: the real scheduler and block manager -------------------------------------------
def paged_step_usages(workload, num_blocks: int, block_size: int, *, max_model_len: int = 2048,
                      max_num_seqs: int = 256, max_num_batched_tokens: int = 2048,
                      enable_prefix_caching: bool = True,
                      on_step: Optional[Callable] = None):
    """Drive minipaged's `Scheduler` + `BlockManager` with a trace; yield (scheduler, usage).

    The loop is `LLMEngine.step()` without the model: schedule, mark the scheduled tokens
    computed and publish full blocks (`cache_full_blocks`), "sample" a placeholder token for
    every sequence that reached its last token, finish it at its output length, then read
    `block_usage(bm)`: the same place the engine records `StepRecord.usage`. With
    `ignore_eos` and fixed output lengths the engine's schedule does not depend on the sampled
    tokens, so this is the engine's memory state step for step (a test checks it).

    `workload`: a `minipaged.lessons.bench.Workload` (its prompt ids are used) or (prompt_len,
    output_len) pairs (prompt ids are then distinct per request, so no prefix is shared).
    """
    from minipaged.engine.block_manager import BlockManager
    from minipaged.sampling import SamplingParams
    from minipaged.engine.scheduler import Scheduler
    from minipaged.engine.sequence import Sequence
    from minipaged.simulator.clock import advance

    if hasattr(workload, "prompts"):
        prompts = [list(p) for p in workload.prompts]
        outputs = list(workload.max_tokens)
    else:
        reqs = requests_from(workload)
        # distinct, non-repeating ids per request: no accidental prefix-cache hits
        prompts = [[(i * 7919 + j) % 1_000_003 + 3 for j in range(r.prompt_len)]
                   for i, r in enumerate(reqs)]
        outputs = [r.output_len for r in reqs]
    bm = BlockManager(num_blocks, block_size, enable_prefix_caching)
    sched = Scheduler(bm, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                      enable_chunked_prefill=True)
    for i, (p, o) in enumerate(zip(prompts, outputs)):
        if len(p) + o > max_model_len:
            raise ValueError(f"request {i}: {len(p)} + {o} tokens exceed "
                             f"max_model_len={max_model_len}")
        sched.add(Sequence(str(i), p, SamplingParams(max_tokens=o, ignore_eos=True, temperature=0)))
    while sched.has_unfinished():
        out = sched.schedule()
        if out.is_empty:
            raise RuntimeError("the scheduler made no progress: the cache is too small for a "
                               "request")
        advance(sched, out, max_model_len)  # the engine's work after a forward, without one
        if on_step is not None:
            on_step(sched, out)
        yield sched, block_usage(bm)


def simulate_paged(workload, num_blocks: int, block_size: int, *, max_model_len: int = 2048,
                   max_num_seqs: int = 256, max_num_batched_tokens: int = 2048,
                   enable_prefix_caching: bool = True) -> WasteResult:
    """The paged strategy: categories from `block_usage` after every step."""
    steps: list[WasteStep] = []
    sched = None
    for sched, u in paged_step_usages(workload, num_blocks, block_size,
                                      max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                                      max_num_batched_tokens=max_num_batched_tokens,
                                      enable_prefix_caching=enable_prefix_caching):
        steps.append(waste_step_from_usage(len(steps), u, len(sched.running), len(sched.waiting)))
    return WasteResult("paged", num_blocks * block_size, steps, block_size=block_size,
                       num_preemptions=sched.num_preemptions if sched else 0)


def waste_step_from_usage(step: int, usage, num_running: int = 0,
                          num_waiting: int = 0) -> WasteStep:
    """The five categories of one `BlockUsage` (paging has no reservation, no external frag.)."""
    bs = usage.block_size
    return WasteStep(step, token_states=usage.num_tokens_stored, reserved=0,
                     internal_fragmentation=usage.internal_fragmentation,
                     external_fragmentation=0,
                     free=(usage.num_free_blocks + usage.num_cached_blocks) * bs,
                     num_running=num_running, num_waiting=num_waiting)


def waste_from_trace(trace, label: str = "minipaged engine") -> WasteResult:
    """The same accounting read from a real engine run (`LLM(..., record_block_tables=True)`)."""
    recs = [r for r in trace if r.usage is not None]
    if not recs:
        raise ValueError("the trace has no usage snapshots: create the LLM with "
                         "record_block_tables=True")
    steps = [waste_step_from_usage(i, r.usage, r.num_running, r.num_waiting)
             for i, r in enumerate(recs)]
    u = recs[0].usage
    return WasteResult("paged", u.num_blocks * u.block_size, steps, block_size=u.block_size,
                       num_preemptions=sum(len(r.preempted) for r in recs),
                       extra={"label": label})


# --- the whole comparison -------------------------------------------------------------------
def make_trace(name: str = "sharegpt", num_requests: int = 200, seed: int = 0,
               max_model_len: int = 2048) -> list[Request]:
    """Lengths drawn like the paper's datasets (exponential, with ShareGPT's or Alpaca's means),
    through `minipaged.lessons.bench.make_workload`, clipped so prompt + output <= max_model_len."""
    from minipaged.benchmark.throughput import make_workload
    wl = make_workload(name, vocab_size=32000, num_requests=num_requests, seed=seed,
                       max_model_len=max_model_len)
    return requests_from(wl)


def compare_strategies(requests, capacity: int, *, block_sizes: Seq[int] = (8, 16, 32, 128),
                       strategies: Seq[str] = CONTIGUOUS_STRATEGIES, max_model_len: int = 2048,
                       max_num_seqs: int = 256,
                       max_num_batched_tokens: int = 2048) -> list[WasteResult]:
    """Every strategy on the same trace and the same cache size (`capacity` slots)."""
    reqs = requests_from(requests)
    kw = dict(max_model_len=max_model_len, max_num_seqs=max_num_seqs,
              max_num_batched_tokens=max_num_batched_tokens)
    results = [simulate_contiguous(reqs, s, capacity, **kw) for s in strategies]
    for bs in block_sizes:
        results.append(simulate_paged(reqs, capacity // bs, bs, **kw))
    return results


def format_table(results: Seq[WasteResult]) -> str:
    """A Markdown table of time-averaged shares (of the taken KV memory) per strategy."""
    rows = ["| strategy | token states | reserved | internal frag. | external frag. | "
            "mean batch | steps |",
            "|---|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        s = r.summary()
        rows.append(f"| {s['strategy']} | {s['token_states']:.1%} | {s['reserved']:.1%} | "
                    f"{s['internal']:.1%} | {s['external']:.1%} | {s['mean_running']:.1f} | "
                    f"{s['steps']} |")
    return "\n".join(rows)


__all__ = ["CATEGORIES", "Request", "WasteStep", "WasteResult", "ContiguousAllocator",
           "reservation", "simulate_contiguous", "simulate_paged", "paged_step_usages",
           "waste_from_trace", "make_trace", "compare_strategies", "format_table", "next_pow2",
           "PAPER_TOKEN_STATE_SHARE"]
