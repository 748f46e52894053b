"""Golden outputs and step traces of the engine as it is, for refactors that must not change them.

Each scenario below runs stories260K on the CPU through the public API (`LLM.generate`,
`LLM.beam_search`; the `arrivals_*` ones through the engine's `add_request`, `step` and
`abort_request`, as the server's engine core does) and keeps what a behaviour-preserving change
must reproduce exactly:

* per request: the prompt's token ids, the prefix-cache hit, and for every completion (each of
  n > 1 samples, each beam, in order) its token ids, text, finish reason and stop reason (and
  the token ids of its logprobs, where asked for; never the float values);
* the engine's step trace (`llm.trace`, engine/trace.py's StepRecord), every field that does
  not depend on the clock: which sequence ran how many prefill / decode tokens from which
  position, preemptions, swaps, finishes, queue lengths, block counts (used / free / cached),
  sharing and copy-on-write, prefix-cache queries and hits, recomputed tokens, speculative
  drafts and acceptances, and in `greedy_*` the block tables themselves. Timings and wait times
  are left out; sequence ids are numbered by first appearance (the engine's counter is global to
  the process), and step numbers count from the scenario's first step;
* the block pool at the end (every block back);
* in `arrivals_*`, what each step streamed: per request, the tokens of each completion so far.

tests/test_golden_traces.py runs the same scenarios (it imports `SCENARIOS` and `run_scenario`
from here) and compares them with traces.json, field by field.

The scenarios cross the two step loops (synchronous, async scheduling forced on) with the
capabilities: greedy with stop strings and stop tokens, chunked prefill, prefix caching (also
across two `generate` calls) and recompute preemption; whole prompts without chunking or prefix
caching under a seat limit; seeded sampling with filters, penalties and logprobs; n > 1; beam
search; swap preemption; LoRA; n-gram and draft-model speculation (also with LoRA and
structured outputs); structured outputs; EOS; requests arriving while others run, and aborts;
tensor parallelism (TP=2 on gloo). Combinations the engine refuses are left out, with the
reason beside `SCENARIOS`. Each is small (a few prompts, at most 60 new tokens, 4-token
blocks) and takes about a second or less on 2 CPU cores, the TP one a few.

Record again only when a change is *meant* to change behaviour, and say so in its commit:

    python -m tests.golden.record              # every scenario, rewrites traces.json
    python -m tests.golden.record NAME ...     # only these; the others keep their records
"""
from __future__ import annotations

import gc
import json
import shutil
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

if __name__ == "__main__" and not __package__:  # run as a script: import this checkout's code
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from minipaged import LLM, BeamSearchParams, LoRARequest, SamplingParams  # noqa: E402
from minipaged.structured_output import StructuredOutputsParams as SO  # noqa: E402

GOLDEN = Path(__file__).with_name("traces.json")

# Every scenario: the CPU, one thread (float sums in one order), the same seed, small blocks.
COMMON = dict(device="cpu", cpu_threads=1, seed=0, block_size=4)

# Mixed lengths; the "Once upon a time, ..." ones share full blocks for the prefix cache.
PROMPTS = (
    "Once upon a time",
    "Once upon a time, there was a little girl named Lily. She loved to play outside",
    "The cat",
    "Tom had a big red ball",
    "Once upon a time, there was a little boy named Tom",
    "Lily and her mom went to the park to see the ducks in the pond",
)
PERIOD = 426  # stories260K's "." token: a stop token, and the EOS of the `eos_*` model


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw)


def greedy_mixed() -> list[SamplingParams]:
    """Lengths, stop strings and stop tokens (with min_tokens) that end requests early."""
    return [greedy(24), greedy(32, ignore_eos=True), greedy(30, stop=[" park"]),
            greedy(20, stop_token_ids=[PERIOD], min_tokens=3), greedy(8),
            greedy(28, stop=["box"], include_stop_str_in_output=True)]


def seeded_mixed() -> list[SamplingParams]:
    """Seeded sampling with every filter, penalties and logprobs (these steps run synchronously
    under async scheduling), and a greedy row beside them."""
    return [SamplingParams(temperature=0.8, seed=1, max_tokens=24),
            SamplingParams(temperature=1.0, top_k=20, seed=2, max_tokens=28),
            SamplingParams(temperature=0.7, top_p=0.9, seed=3, max_tokens=20),
            SamplingParams(temperature=1.0, min_p=0.1, seed=4, max_tokens=24,
                           repetition_penalty=1.3),
            SamplingParams(temperature=0.9, seed=5, max_tokens=16, presence_penalty=0.5,
                           frequency_penalty=0.5),
            greedy(24, logprobs=3)]


def samples_mixed() -> list[SamplingParams]:
    """n > 1: seeded sample groups (one of them greedy) beside single requests."""
    return [SamplingParams(n=3, temperature=0.8, seed=7, max_tokens=20),
            greedy(24),
            SamplingParams(n=2, temperature=1.0, top_k=30, seed=8, max_tokens=24),
            SamplingParams(n=2, temperature=0.0, max_tokens=16),
            SamplingParams(temperature=0.8, seed=9, max_tokens=20),
            SamplingParams(n=4, temperature=0.6, seed=10, max_tokens=12, min_tokens=2,
                           stop_token_ids=[PERIOD])]


def beams() -> BeamSearchParams:
    return BeamSearchParams(beam_width=3, max_tokens=16)


def speculative_mixed() -> list[SamplingParams]:
    """Greedy (the case speculation must not change) and one seeded sample."""
    return [greedy(24), greedy(32, ignore_eos=True), greedy(30),
            greedy(20, stop_token_ids=[PERIOD], min_tokens=3),
            SamplingParams(temperature=0.8, seed=11, max_tokens=16), greedy(28)]


def speculative_constrained() -> list[SamplingParams]:
    """Greedy rows, two of them constrained (a regex, a JSON schema), for speculation."""
    return [greedy(24), greedy(24, structured_outputs=CONSTRAINTS[1]), greedy(30),
            greedy(20, structured_outputs=CONSTRAINTS[3]), greedy(16), greedy(28)]


FLAGS = {"type": "object", "additionalProperties": False, "required": ["ok", "n"],
         "properties": {"ok": {"type": "boolean"},
                        "n": {"type": "integer", "minimum": 1, "maximum": 9}}}
CONSTRAINTS = (SO(json=FLAGS), SO(regex=r"[A-Z][a-z]{1,8} is \d{1,2} years old\."),
               SO(choice=["yes", "no", "the cat sat"]),
               SO(json=FLAGS, disable_any_whitespace=True))


def structured_mixed() -> list[SamplingParams]:
    """Every constraint kind greedy, one sampled, and unconstrained rows in the same batch."""
    json_, regex, choice, compact = CONSTRAINTS
    return [greedy(40, structured_outputs=json_), greedy(24),
            greedy(32, structured_outputs=regex), greedy(16, structured_outputs=choice),
            SamplingParams(temperature=1.0, seed=12, max_tokens=40, structured_outputs=compact),
            greedy(20)]


def eos_mixed() -> list[SamplingParams]:
    """With "." as EOS: most stop at it, one ignores it, one hits max_model_len."""
    return [greedy(40), greedy(40, ignore_eos=True), greedy(40), greedy(60), greedy(8),
            greedy(40, min_tokens=12)]


def arrivals() -> list[tuple]:
    """Requests that arrive while others run, and aborts: ("add", before step, request id,
    prompt index, params, adapter number or None) and ("abort", before step, request id).
    A group, a waiting request and a beam search are aborted mid-way."""
    regex, choice = CONSTRAINTS[1], CONSTRAINTS[2]
    return [("add", 0, "r0", 0, greedy(24), None),
            ("add", 0, "r1", 1, SamplingParams(n=2, temperature=0.8, seed=21, max_tokens=20), 1),
            ("add", 2, "r2", 2, BeamSearchParams(beam_width=2, max_tokens=12), 2),
            ("add", 2, "r3", 3, greedy(30, structured_outputs=regex), None),
            ("abort", 4, "r1"),
            ("add", 5, "r4", 4, greedy(20), None),
            ("add", 5, "r5", 5, SamplingParams(n=3, temperature=1.0, seed=22, max_tokens=16,
                                               structured_outputs=choice), None),
            ("abort", 6, "r4"),
            ("add", 9, "r6", 0, greedy(16), 1),
            ("add", 9, "r7", 1, greedy(12, stop=[" play"]), None),
            ("abort", 12, "r2")]


# Chunked prefill in 16-token steps and a cache far smaller than the workload: recompute
# preemptions and readmissions (prefix hits on the way back).
TIGHT = dict(num_blocks=20, max_model_len=64, max_num_batched_tokens=16)


@dataclass(frozen=True)
class Scenario:
    name: str
    params: Optional[Callable[[], object]] = None  # a fresh list of SamplingParams (one per
    #                                  prompt) for `llm.generate`, or BeamSearchParams for
    #                                  `llm.beam_search`
    events: Optional[Callable[[], list]] = None  # instead: `arrivals`, driven through the
    #                                  engine's add_request / step / abort_request, streamed
    engine: dict = field(default_factory=dict)  # LLM keywords on top of COMMON; a value
    #                                             "@eos_model" / "@draft_model" names an asset
    prompts: tuple = PROMPTS
    loras: Optional[tuple] = None  # per prompt: adapter number (1, 2, ...) or None (the base)
    rounds: int = 1  # generate calls with the same prompts (later ones hit the prefix cache)
    warm_grammars: bool = False  # compile the constraints first (see `run_scenario`)
    tensor_parallel: bool = False  # spawns worker processes (gloo)


def _both_loops(name: str, **kw) -> list[Scenario]:
    """The scenario with the synchronous step loop, and with async scheduling forced on."""
    engine = kw.pop("engine", {})
    return [Scenario(f"{name}_sync", engine={**engine, "async_scheduling": False}, **kw),
            Scenario(f"{name}_async", engine={**engine, "async_scheduling": True}, **kw)]


SCENARIOS: dict[str, Scenario] = {s.name: s for s in [
    *_both_loops("greedy", params=greedy_mixed, rounds=2,
                 engine={**TIGHT, "record_block_tables": True}),
    # No chunked prefill (a prompt is prefilled whole), no prefix caching, at most 3 sequences.
    *_both_loops("unchunked", params=greedy_mixed, engine=dict(
        num_blocks=20, max_model_len=64, max_num_batched_tokens=64, max_num_seqs=3,
        enable_chunked_prefill=False, enable_prefix_caching=False)),
    *_both_loops("seeded", params=seeded_mixed, engine=TIGHT),
    *_both_loops("n_samples", params=samples_mixed,
                 engine=dict(num_blocks=40, max_model_len=96, max_num_batched_tokens=32)),
    *_both_loops("beam_search", params=beams, prompts=PROMPTS[:4],
                 engine=dict(num_blocks=36, max_model_len=64, max_num_batched_tokens=16)),
    *_both_loops("swap", params=samples_mixed,
                 engine=dict(num_blocks=28, max_model_len=96, preemption_mode="swap")),
    *_both_loops("lora", params=greedy_mixed, loras=(1, None, 2, 1, None, 2),
                 engine={**TIGHT, "enable_lora": True, "max_loras": 1, "max_lora_rank": 8}),
    *_both_loops("structured", params=structured_mixed, warm_grammars=True,
                 engine=dict(num_blocks=32, max_model_len=96, max_num_batched_tokens=16)),
    *_both_loops("arrivals", events=arrivals, warm_grammars=True, engine=dict(
        num_blocks=40, max_model_len=64, max_num_batched_tokens=16, max_num_seqs=8,
        enable_lora=True, max_loras=2, max_lora_rank=8)),
    *_both_loops("eos", params=eos_mixed,
                 engine=dict(model="@eos_model", num_blocks=16, max_model_len=48)),
    # Left out, because the engine refuses them: speculation with async_scheduling=True (a
    # verify step needs its tokens at once), with n > 1 or beam search (refused per request),
    # with tensor_parallel_size > 1; a draft model with preemption_mode="swap"; LoRA with
    # tensor_parallel_size > 1. So speculation runs synchronously, n-gram also under swap.
    Scenario("spec_ngram_sync", params=speculative_mixed, engine={
        **TIGHT, "max_num_batched_tokens": 24, "async_scheduling": False, "speculative_config": {
            "method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}}),
    Scenario("spec_ngram_swap_sync", params=speculative_mixed, engine={
        **TIGHT, "preemption_mode": "swap", "async_scheduling": False, "speculative_config": {
            "method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 2}}),
    Scenario("spec_draft_sync", params=speculative_mixed, engine={
        **TIGHT, "max_num_batched_tokens": 24, "async_scheduling": False, "speculative_config": {
            "method": "draft_model", "model": "@draft_model", "num_speculative_tokens": 3}}),
    Scenario("spec_ngram_lora_structured_sync", params=speculative_constrained,
             loras=(1, None, 2, 1, None, 2), warm_grammars=True,
             engine={**TIGHT, "enable_lora": True, "max_loras": 2, "max_lora_rank": 8,
                     "async_scheduling": False, "speculative_config": {
                         "method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}}),
    # Tensor parallelism: one scenario (its workers take seconds to spawn), greedy_sync's
    # workload and loop: its record must equal greedy_sync's (the test checks it).
    Scenario("tp2_sync", params=greedy_mixed, rounds=2, tensor_parallel=True, engine={
        **TIGHT, "record_block_tables": True, "tensor_parallel_size": 2,
        "async_scheduling": False}),
]}


# --- what a scenario needs on disk ----------------------------------------------------------------
class Assets:
    """Models and adapters made on demand under `root`, the same bytes every time: stories260K
    with "." as its EOS, a draft model (stories260K's first 4 of 5 layers), random LoRA
    adapters."""

    def __init__(self, root):
        self.root = Path(root)
        self._made: dict[str, str] = {}

    def _stories(self) -> Path:
        from minipaged.models.loader import resolve_builtin
        return Path(resolve_builtin("stories260K"))

    def _copy(self, name: str, edit_config: Callable[[dict], None]) -> Path:
        dst = self.root / name
        shutil.copytree(self._stories(), dst)
        cfg_path = dst / "config.json"
        cfg = json.loads(cfg_path.read_text())
        edit_config(cfg)
        cfg_path.write_text(json.dumps(cfg, indent=2))
        return dst

    def eos_model(self) -> str:
        def edit(cfg):
            cfg["eos_token_id"] = PERIOD
        path = self._copy("eos_model", edit)
        gen = path / "generation_config.json"
        if gen.exists():
            gen_cfg = json.loads(gen.read_text())
            gen_cfg["eos_token_id"] = PERIOD
            gen.write_text(json.dumps(gen_cfg, indent=2))
        return str(path)

    def draft_model(self) -> str:
        """stories260K without its last layer (4 of 5): it agrees with the target often, not
        always, so drafts are accepted at every position and rejected too."""
        from safetensors.torch import load_file, save_file
        keep = 4

        def edit(cfg):
            cfg["num_hidden_layers"] = keep
        path = self._copy("draft_model", edit)
        weights = path / "model.safetensors"
        tensors = {k: v for k, v in load_file(str(weights)).items()
                   if not k.startswith("model.layers.") or int(k.split(".")[2]) < keep}
        save_file(tensors, str(weights), metadata={"format": "pt"})
        return str(path)

    def adapter(self, number: int) -> LoRARequest:
        """A random rank-8 adapter on every projection (seeded by its number)."""
        key = f"adapter{number}"
        if key not in self._made:
            from minipaged.lora.random_adapter import save_random_adapter
            from minipaged.models.config import ModelConfig
            from minipaged.models.loader import resolve_model
            cfg = ModelConfig.from_dict(resolve_model("stories260K").config)
            self._made[key] = save_random_adapter(str(self.root / key), cfg, rank=8,
                                                  lora_alpha=16, seed=number, std=0.2)
        return LoRARequest(key, number, self._made[key])

    def resolve(self, value):
        """`value` with every "@name" string replaced by the asset's path."""
        if isinstance(value, dict):
            return {k: self.resolve(v) for k, v in value.items()}
        if isinstance(value, str) and value.startswith("@"):
            if value not in self._made:
                self._made[value] = getattr(self, value[1:])()
            return self._made[value]
        return value


# --- one scenario, as plain data ------------------------------------------------------------------
def _completion(c) -> dict:
    out = {"token_ids": list(c.token_ids), "text": c.text, "finish_reason": c.finish_reason,
           "stop_reason": c.stop_reason}
    if c.logprobs is not None:  # which tokens, in their order; the values are floats
        out["logprob_token_ids"] = [list(d) for d in c.logprobs]
    return out


def _request(out) -> dict:
    return {"request_id": out.request_id, "prompt_token_ids": list(out.prompt_token_ids),
            "num_cached_tokens": out.num_cached_tokens,
            "lora": out.lora_request.lora_name if out.lora_request else None,
            "outputs": [dict(index=c.index, **_completion(c)) for c in out.outputs]}


def _beam_request(out) -> dict:
    return {"sequences": [{"tokens": list(s.tokens), "text": s.text,
                           "finish_reason": s.finish_reason, "stop_reason": s.stop_reason}
                          for s in out.sequences]}


# StepRecord fields kept in every step, and those kept only when they are not empty / zero.
ALWAYS = ("num_waiting", "num_running", "num_blocks_used", "num_blocks_free",
          "num_blocks_cached", "num_batched_tokens")
WHEN_SET = ("preempted", "finished", "swapped_out", "swapped_in", "num_swapped_bytes",
            "num_recomputed_tokens", "num_blocks_saved_by_sharing", "num_cow_copies",
            "num_prefix_query_tokens", "num_prefix_hit_tokens", "num_draft_tokens_per_pos",
            "num_accepted_tokens_per_pos")


def trace_of(records) -> list[dict]:
    """The clock-free part of every StepRecord. `scheduled` is one row per sequence: [name
    (request id, or "request_id/index" in a group), sequence number (by first appearance),
    prefill tokens, decode tokens, tokens computed before, prefix-cache tokens at admission]."""
    records = list(records)
    first = records[0].step if records else 0
    numbers: dict[int, int] = {}

    def number(seq_id: int) -> int:
        return numbers.setdefault(seq_id, len(numbers))

    steps = []
    for r in records:
        step = {"step": r.step - first,
                "scheduled": [[e.key, number(e.seq_id), e.num_prefill_tokens,
                               e.num_decode_tokens, e.num_computed_before, e.num_cached_tokens]
                              for e in r.scheduled]}
        step.update({f: getattr(r, f) for f in ALWAYS})
        step.update({f: list(v) if isinstance(v, list) else v
                     for f in WHEN_SET if (v := getattr(r, f))})
        if r.usage is not None:
            u = r.usage
            step["usage"] = [u.num_used_blocks, u.num_cached_blocks, u.num_free_blocks,
                             u.num_tokens_stored]
        if r.block_tables is not None:
            step["block_tables"] = {k: list(v) for k, v in sorted(r.block_tables.items())}
        steps.append(step)
    return steps


def run_scenario(sc: Scenario, assets: Assets) -> dict:
    """Run `sc` in a fresh LLM: {"requests", "end", "trace"} as plain JSON-able data."""
    engine = assets.resolve({**COMMON, **sc.engine})
    llm = LLM(**engine)
    try:
        if sc.warm_grammars:
            # A grammar compiles on a worker thread and a request waits for it as long as it
            # takes, so *when* it joins the batch depends on the clock. Compiled (and cached)
            # first, one request at a time, each request below joins at once. A 1-token prompt
            # leaves no full block in the prefix cache; the warm-up's steps are not recorded.
            for so in CONSTRAINTS:
                llm.generate([[1]], greedy(1, structured_outputs=so), use_tqdm=False)
        start = len(llm.trace)
        loras = ([None if n is None else assets.adapter(n) for n in sc.loras]
                 if sc.loras else None)
        requests, streamed = [], None
        if sc.events is not None:
            requests, streamed = _drive(llm, sc.events(), assets)
        for _ in range(sc.rounds if sc.params is not None else 0):
            params = sc.params()
            if isinstance(params, BeamSearchParams):
                outs = llm.beam_search(list(sc.prompts), params, lora_request=loras)
                requests += [_beam_request(o) for o in outs]
            else:
                outs = llm.generate(list(sc.prompts), params, use_tqdm=False,
                                    lora_request=loras)
                requests += [_request(o) for o in outs]
        trace = trace_of(list(llm.trace)[start:])
        eng = llm.engine
        end = {"num_blocks": eng.num_blocks,
               "num_free_blocks": eng.block_manager.num_free_blocks,
               "has_unfinished_requests": eng.has_unfinished_requests()}
    finally:
        del llm
        gc.collect()  # tensor parallel: the workers stop with the engine
    out = {"requests": requests, "end": end, "trace": trace}
    if streamed is not None:
        out["streamed"] = streamed
    return out


def _drive(llm, events: list[tuple], assets: Assets) -> tuple[list, list]:
    """Run `events` through the engine, as the server's engine core does: the finished
    requests (in the order they finished), and per step what it streamed: [request id, tokens
    of each completion, finished]."""
    engine = llm.engine
    engine.stream_outputs = True
    finished, streamed = [], []
    step = 0
    while events or engine.has_unfinished_requests():
        while events and events[0][1] <= step:
            event = events.pop(0)
            if event[0] == "add":
                _, _, rid, prompt, params, lora = event
                engine.add_request(rid, PROMPTS[prompt], params,
                                   lora_request=None if lora is None else assets.adapter(lora))
            else:
                engine.abort_request(event[2])
        outs = engine.step()
        streamed.append([[o.request_id, [len(c.token_ids) for c in o.outputs], o.finished]
                         for o in outs])
        finished += [_request(o) for o in outs if o.finished]
        step += 1
    return finished, streamed


# --- the file ---------------------------------------------------------------------------------
def dumps(golden: dict) -> str:
    """Compact JSON, one line per scenario's requests and per step (readable diffs)."""
    def j(x):
        return json.dumps(x, separators=(",", ":"), ensure_ascii=False)
    def per_line(key, value):
        if key in ("trace", "streamed"):  # a line per step
            return f"{j(key)}:[\n" + ",\n".join(j(s) for s in value) + "]"
        return f"{j(key)}:{j(value)}"
    return "{\n" + ",\n".join(
        f"{j(name)}:{{" + ",\n".join(per_line(k, v) for k, v in rec.items()) + "}"
        for name, rec in golden.items()) + "\n}\n"


def load() -> dict:
    return json.loads(GOLDEN.read_text())


def main(names: list[str]) -> None:
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown:
        raise SystemExit(f"unknown scenarios {unknown}; known: {list(SCENARIOS)}")
    torch.set_num_threads(1)
    golden = load() if names and GOLDEN.exists() else {}
    with tempfile.TemporaryDirectory() as tmp:
        assets = Assets(tmp)
        for name, sc in SCENARIOS.items():
            if names and name not in names:
                continue
            golden[name] = run_scenario(sc, assets)
            rec = golden[name]
            print(f"{name}: {len(rec['trace'])} steps, "
                  f"{sum(len(s.get('preempted', [])) for s in rec['trace'])} preemptions")
    golden = {n: golden[n] for n in SCENARIOS if n in golden}  # SCENARIOS' order
    GOLDEN.write_text(dumps(golden))
    print(f"wrote {GOLDEN} ({GOLDEN.stat().st_size} bytes)")


if __name__ == "__main__":
    main(sys.argv[1:])
