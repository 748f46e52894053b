"""The capstone: your engine, every stage you wrote swapped in at once, on stories260K.

    minipaged exercise capstone          (python -m minipaged.exercises.capstone --dir exercises)

A stage is *yours* when its file in the workspace defines every function of the stage and none
of them is still the skeleton's; the project's code runs every other stage. With all of yours
in place (grading.swap_in), the capstone runs real workloads and compares them with references
that do not share your code:

    greedy parity     the 24 prompts of tests/test_parity.py's preemption test (a cache of 24
                      blocks of 8, a budget of 32 tokens: recompute preemption, chunked prefill),
                      a story, and a request of n = 2 samples, together: token-exact with
                      Hugging Face's greedy `generate`. Attention is your online softmax when
                      that stage is yours (one sequence at a time).
    seeded sampling   temperature / top-k / top-p / min-p with seeds, and n = 2: the same tokens
                      as the project's engine (run first, before the swap)
    beam search       3 beams: the same beams as Hugging Face's `generate(num_beams=3)`
    speculation       n-gram proposals verified by the rejection rule: seeded sampled requests
                      equal the project's engine, greedy ones Hugging Face
    priorities        (when that stage is yours) the priority policy under a full cache: a
                      late urgent request preempts its way in and finishes first, every
                      sequence token-exact with Hugging Face
    Triton kernels    (when that stage is yours) the engine attending with your kernels, under
                      the Triton interpreter on a CPU: token-exact with Hugging Face

It draws the block tables and the batch composition from your engine's trace of the parity run
(figures in --out) and writes everything to report.json. A learner's exception is reported with
the line of their file it came from, and the run goes on with the next workload.
"""
from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():  # the Triton stage runs in the interpreter: set before any
    os.environ.setdefault("TRITON_INTERPRET", "1")  # kernel (the learner's included) is defined

import argparse  # noqa: E402
import json  # noqa: E402
import random  # noqa: E402
import sys  # noqa: E402
import traceback  # noqa: E402
from dataclasses import asdict, dataclass, field  # noqa: E402
from pathlib import Path  # noqa: E402
from types import ModuleType  # noqa: E402
from typing import Callable, Optional  # noqa: E402

from minipaged.exercises.grading import (ExerciseFileError, Undo, load_learner_module,  # noqa: E402
                                         swap_in, undo_swap, written_functions)
from minipaged.exercises.progress import DEFAULT_WORKSPACE, stage_file  # noqa: E402
from minipaged.exercises.stages import STAGES  # noqa: E402

# tests/test_parity.py::test_stories260k_under_preemption_and_chunked_prefill's engine and prompts
PARITY_ENGINE = dict(block_size=8, num_blocks=24, max_model_len=128, max_num_batched_tokens=32)
STORY = "Once upon a time"
PAIR = "Tom had a big red ball"  # the request of n = 2 samples
# The readable path on the CPU, whatever the machine: the reference backend, `ModelRunner`
# (whose prepare_inputs is a stage), fp32 like Hugging Face's reference.
CPU = dict(device="cpu", attention_backend="torch_ref")


def parity_prompts(n: int = 24, lo: int = 20, hi: int = 60, seed: int = 7) -> list[list[int]]:
    """The parity test's random prompts: BOS, then lengths in [lo, hi] of ids 3..511."""
    rng = random.Random(seed)
    return [[1] + [rng.randrange(3, 512) for _ in range(rng.randint(lo, hi) - 1)]
            for _ in range(n)]


@dataclass
class Workspace:
    """The learner's stages: their modules, and what the capstone does with each stage."""

    modules: dict[str, ModuleType] = field(default_factory=dict)  # the stages that are yours
    states: dict[str, str] = field(default_factory=dict)  # stage -> "yours" or why not

    @property
    def yours(self) -> list[str]:
        return [st.name for st in STAGES if st.name in self.modules]


def read_workspace(workspace: Path) -> Workspace:
    ws = Workspace()
    for st in STAGES:
        path = stage_file(workspace, st)
        if not path.is_file():
            ws.states[st.name] = "reference (not started)"
            continue
        try:
            module = load_learner_module(st, path)
        except ExerciseFileError as e:
            ws.states[st.name] = f"reference (your file does not load: {e})"
            continue
        written = written_functions(st, module)
        if len(written) == len(st.functions):
            ws.modules[st.name] = module
            ws.states[st.name] = "yours"
        else:
            ws.states[st.name] = (f"reference ({len(written)} of {len(st.functions)} functions "
                                  "written)")
    return ws


def attend_one_sequence_at_a_time(self, q, k_cache, v_cache, metadata, scale):
    """`TorchRefBackend.attend` while the online_softmax stage is yours: each sequence's queries
    through `online_softmax_attention` (yours, swapped into its module)."""
    from minipaged.attention import online_softmax
    out = torch.empty_like(q)  # (num_tokens, num_heads, head_dim)
    start = 0
    for i, (q_len, ctx) in enumerate(zip(metadata.query_lens, metadata.context_lens_host)):
        out[start:start + q_len] = online_softmax.online_softmax_attention(
            q[start:start + q_len], k_cache, v_cache, metadata.block_tables[i], ctx, scale)
        start += q_len
    return out


def swap_workspace(ws: Workspace) -> Undo:
    """Every stage of yours in place at once; the reference backend's attention goes through
    your online softmax when that stage is yours."""
    undo = Undo()
    for st in STAGES:
        if st.name in ws.modules:
            part = swap_in(st, ws.modules[st.name])
            undo.replaced += part.replaced
            undo.pairs += part.pairs
    if "online_softmax" in ws.modules:
        from minipaged.attention.torch_ref import TorchRefBackend
        undo.replaced.append((TorchRefBackend, "attend", vars(TorchRefBackend)["attend"]))
        TorchRefBackend.attend = attend_one_sequence_at_a_time
    return undo


@dataclass
class Check:
    name: str
    stages: list[str]  # the stages whose code it runs
    passed: bool = False
    detail: str = ""
    error: Optional[str] = None  # what raised, pointing at the learner's line when it is theirs


def learner_frame(exc: BaseException, ws: Workspace) -> str:
    """The innermost line of the learner's files in `exc`'s traceback, as "file:line in fn"."""
    files = {str(Path(m.__file__).resolve()): name for name, m in ws.modules.items()}
    found = ""
    for frame in traceback.extract_tb(exc.__traceback__):
        stage = files.get(str(Path(frame.filename).resolve()))
        if stage is not None:
            found = (f"stage {stage}, {frame.filename}:{frame.lineno} in {frame.name}: "
                     f"{(frame.line or '').strip()}")
    return found


def run_check(check: Check, ws: Workspace, body: Callable[[], tuple[bool, str]],
              show_traceback: bool) -> Check:
    try:
        check.passed, check.detail = body()
    except Exception as exc:  # the learner's code may raise anything; the capstone goes on
        where = learner_frame(exc, ws)
        check.error = f"{type(exc).__name__}: {exc}" + (f"\nraised in {where}" if where else "")
        if show_traceback:
            traceback.print_exception(exc)
    return check


def tokens_of(outputs) -> list[list[int]]:
    return [list(c.token_ids) for o in outputs for c in o.outputs]


class Runs:
    """The workloads, each a method returning (passed, detail); the references they need are
    computed before the swap (`reference_runs`) or by Hugging Face."""

    def __init__(self, out: Path):
        from minipaged.benchmark.hf_baselines import load_hf_model, quiet_transformers
        from minipaged.models.loader import resolve_model
        self.out = out
        from transformers.utils import logging as hf_logging
        hf_logging.disable_progress_bar()  # (the report is what the capstone prints)
        with quiet_transformers():
            self.hf = load_hf_model(str(resolve_model("stories260K").path))
        self.reference: dict[str, list[list[int]]] = {}
        self.parity_llm = None  # the parity run's LLM: its trace is drawn
        self.story = ""

    def hf_greedy(self, prompts: list[list[int]], n: int) -> list[list[int]]:
        from minipaged.benchmark.hf_baselines import hf_sequential
        return hf_sequential(self.hf, prompts, [n] * len(prompts)).outputs

    # -- the workloads -------------------------------------------------------------------------
    def sampled(self):
        from minipaged import LLM, SamplingParams
        llm = LLM("stories260K", **CPU, block_size=8)
        prompts = ["Once upon a time", "The little dog", "Lily wanted to", "One day, a girl"]
        params = [SamplingParams(temperature=0.8, top_k=40, top_p=0.9, min_p=0.02, seed=i,
                                 max_tokens=16, ignore_eos=True) for i in range(4)]
        params.append(SamplingParams(n=2, temperature=1.0, top_p=0.95, seed=7, max_tokens=16,
                                     ignore_eos=True))
        return tokens_of(llm.generate(prompts + [PAIR], params, use_tqdm=False))

    def speculative(self):
        from minipaged import LLM, SamplingParams
        spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}
        llm = LLM("stories260K", **CPU, block_size=8,
                  speculative_config=spec)
        prompts = ["Once upon a time", "Tom had a big red ball. Tom had a", "The sun"]
        params = [SamplingParams(temperature=0.8, seed=i, max_tokens=24, ignore_eos=True)
                  for i in range(len(prompts))]
        sampled = tokens_of(llm.generate(prompts, params, use_tqdm=False))
        greedy = tokens_of(llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=24,
                                                                ignore_eos=True),
                                        use_tqdm=False))
        tok = llm.get_tokenizer()
        return sampled, greedy, [tok(p).input_ids for p in prompts]

    def reference_runs(self) -> None:
        """The project's engine on the seeded workloads, before anything of yours is in."""
        self.reference["sampled"] = self.sampled()
        self.reference["speculative"] = self.speculative()[0]

    def greedy_parity(self) -> tuple[bool, str]:
        from minipaged import LLM, SamplingParams
        llm = self.parity_llm = LLM("stories260K", **CPU,
                                    record_block_tables=True, **PARITY_ENGINE)
        tok = llm.get_tokenizer()
        prompts = parity_prompts()
        story, pair = tok(STORY).input_ids, tok(PAIR).input_ids
        greedy = dict(temperature=0.0, ignore_eos=True)
        params = ([SamplingParams(max_tokens=30, **greedy)] * len(prompts)
                  + [SamplingParams(max_tokens=40, **greedy),
                     SamplingParams(n=2, max_tokens=20, **greedy)])
        outs = llm.generate(prompts + [story, pair], params, use_tqdm=False)
        mine = tokens_of(outs)
        want = (self.hf_greedy(prompts, 30) + self.hf_greedy([story], 40)
                + self.hf_greedy([pair], 20) * 2)
        self.story = STORY + outs[len(prompts)].outputs[0].text
        same = sum(a == b for a, b in zip(mine, want))
        pre = sum(len(r.preempted) for r in llm.trace)
        return same == len(want), (f"{same} of {len(want)} sequences token-exact with HF "
                                   f"greedy ({len(llm.trace)} steps, {pre} preemptions)")

    def seeded_sampling(self) -> tuple[bool, str]:
        mine, want = self.sampled(), self.reference["sampled"]
        same = sum(a == b for a, b in zip(mine, want))
        return same == len(want), (f"{same} of {len(want)} sequences equal the project's "
                                   "engine's (same seeds)")

    def beam_search(self) -> tuple[bool, str]:
        from minipaged import LLM, BeamSearchParams
        from minipaged.benchmark.hf_baselines import quiet_transformers
        llm = LLM("stories260K", **CPU, block_size=8, num_blocks=256)
        ids = llm.get_tokenizer()("Lily and her mom").input_ids
        out = llm.beam_search([ids], BeamSearchParams(beam_width=3, max_tokens=16,
                                                      ignore_eos=True))[0]
        x = torch.tensor([ids])
        with torch.no_grad(), quiet_transformers():
            ref = self.hf.generate(x, attention_mask=torch.ones_like(x), num_beams=3,
                                   num_return_sequences=3, do_sample=False, max_new_tokens=16,
                                   pad_token_id=0, eos_token_id=-1)
        want = [r[len(ids):].tolist() for r in ref]
        mine = [s.tokens[len(ids):] for s in out.sequences]
        return mine == want, f"{sum(a == b for a, b in zip(mine, want))} of 3 beams equal HF's"

    def speculation(self) -> tuple[bool, str]:
        sampled, greedy, prompt_ids = self.speculative()
        same = sum(a == b for a, b in zip(sampled, self.reference["speculative"]))
        hf = self.hf_greedy(prompt_ids, 24)
        exact = sum(a == b for a, b in zip(greedy, hf))
        ok = same == len(sampled) and exact == len(hf)
        return ok, (f"seeded: {same} of {len(sampled)} equal the project's engine; greedy: "
                    f"{exact} of {len(hf)} token-exact with HF")

    def priorities(self) -> tuple[bool, str]:
        """tests/test_priority_scheduling.py's engine run: four priority-1 requests fill a cache
        of 24 blocks of 16; an urgent one (priority 0) arrives then, preempts its way in and
        must finish first, every sequence token-exact with Hugging Face's greedy output."""
        from minipaged import LLM, SamplingParams
        llm = LLM("stories260K", **CPU, scheduling_policy="priority", num_blocks=24,
                  block_size=16, max_num_seqs=8, max_model_len=256)
        eng, tok = llm.engine, llm.get_tokenizer()
        lows = [tok(f"Once upon a time there was a {w}").input_ids
                for w in ("cat", "dog", "bird", "fish")]
        urgent = tok(PAIR).input_ids
        for i, ids in enumerate(lows):
            eng.add_request(f"low{i}", ids, SamplingParams(temperature=0.0, max_tokens=150,
                                                           ignore_eos=True), priority=1)
        while eng.block_manager.num_free_blocks > 1:
            eng.step()
        preempted_before = sum(len(r.preempted) for r in eng.trace)
        eng.add_request("urgent", urgent, SamplingParams(temperature=0.0, max_tokens=40,
                                                         ignore_eos=True), priority=0)
        finished, mine = [], {}
        while eng.has_unfinished_requests():
            for out in eng.step():
                if out.finished:
                    finished.append(out.request_id)
                    mine[out.request_id] = list(out.outputs[0].token_ids)
        want = dict(zip([f"low{i}" for i in range(4)], self.hf_greedy(lows, 150)))
        want["urgent"] = self.hf_greedy([urgent], 40)[0]
        same = sum(mine.get(r) == t for r, t in want.items())
        pre = sum(len(r.preempted) for r in eng.trace) - preempted_before
        ok = finished[:1] == ["urgent"] and pre > 0 and same == len(want)
        return ok, (f"finishing order {', '.join(finished)} ({pre} preemptions after the urgent "
                    f"request arrived); {same} of {len(want)} sequences token-exact with HF "
                    "greedy")

    def triton_kernels(self) -> tuple[bool, str]:
        from minipaged import LLM, SamplingParams
        device = "cuda" if torch.cuda.is_available() else "cpu"  # (the interpreter on a CPU)
        llm = LLM("stories260K", device=device, attention_backend="triton", block_size=8,
                  num_blocks=64)
        tok = llm.get_tokenizer()
        prompts = [tok(p).input_ids for p in ("Once upon a time", "The little dog")]
        mine = tokens_of(llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=6,
                                                              ignore_eos=True), use_tqdm=False))
        want = self.hf_greedy(prompts, 6)
        same = sum(a == b for a, b in zip(mine, want))
        return same == len(want), (f"{same} of {len(want)} sequences token-exact with HF "
                                   "greedy, attending with your kernels")


def run_capstone(workspace: Path, out: Path, show_traceback: bool = False) -> dict:
    """Everything above; returns the report (also written to out/report.json)."""
    from minipaged.exercises.capstone_report import draw_figures, print_report
    out.mkdir(parents=True, exist_ok=True)
    ws = read_workspace(workspace)
    runs = Runs(out)
    runs.reference_runs()
    undo = swap_workspace(ws)
    checks = []
    try:
        # Every workload runs the core: blocks, tables, admission, the running set, the inputs.
        core = ["block_allocator", "block_manager", "prepare_inputs", "admission", "scheduler"]
        plan = [
            ("greedy parity", runs.greedy_parity, core + ["step_loop", "online_softmax", "fork"]),
            ("seeded sampling", runs.seeded_sampling,
             core + ["step_loop", "sampler", "online_softmax", "fork"]),
            ("beam search", runs.beam_search,
             core + ["step_loop", "online_softmax", "fork", "beam_search"]),
            ("speculation", runs.speculation, core + ["online_softmax", "rejection_sampler"]),
        ]
        if "priority" in ws.modules:  # the other workloads are first come, first served
            plan.append(("priorities", runs.priorities, core + ["step_loop", "online_softmax",
                                                                "priority"]))
        if "triton_attention" in ws.modules:
            plan.append(("Triton kernels", runs.triton_kernels,
                         core + ["step_loop", "triton_attention"]))
        for name, body, stages in plan:
            checks.append(run_check(Check(name, stages), ws, body, show_traceback))
        figures = draw_figures(runs.parity_llm, out, len(ws.yours)) if runs.parity_llm else {}
    finally:
        undo_swap(undo)
    report = {"yours": ws.yours, "stages": ws.states, "checks": [asdict(c) for c in checks],
              "story": runs.story, "figures": figures,
              "trace": trace_summary(runs.parity_llm),
              "passed": all(c.passed for c in checks)}
    (out / "report.json").write_text(json.dumps(report, indent=1) + "\n")
    print_report(report, out)
    return report


def trace_summary(llm) -> dict:
    if llm is None or not llm.trace:
        return {}
    trace = llm.trace
    return {"steps": len(trace), "preemptions": sum(len(r.preempted) for r in trace),
            "max_batch": max(len(r.scheduled) for r in trace)}


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="minipaged exercise capstone", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", type=Path, default=DEFAULT_WORKSPACE, help="the workspace")
    ap.add_argument("--out", type=Path, help="report and figures (default: <dir>/capstone)")
    ap.add_argument("--traceback", action="store_true",
                    help="print the whole traceback of an exception, not just your line")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)  # stories260K is tiny: one thread is as fast and shares the CPU
    report = run_capstone(a.dir, a.out or a.dir / "capstone", a.traceback)
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
