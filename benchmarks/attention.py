"""Paged attention on the GPU: minipaged's Triton kernels beside SDPA and FlexAttention.

Qwen3-0.6B attention shapes (16 query heads, 8 KV heads, head_dim 128, bf16), KV-cache block size
16, physical blocks shuffled (as a busy cache hands them out). The baselines read the SAME keys and
values from contiguous (batch, kv_heads, len, head_dim) tensors, the best case for them:

* decode  batch 1/16/64/256 x context 512/4096/16384: one query token per sequence
* prefill a few prompt sizes, causal; one is a 512-token chunk on top of 3,584 cached tokens

Every variant is captured in a CUDA graph and timed with `triton.testing.do_bench` (median of
many replays, L2 flushed before each), so Python launch overhead is not in the numbers.
Bandwidth = bytes of K + V + Q + O that must move / time, beside its share of 4.3 TB/s (the
H200's measured copy rate is about 4.27 TB/s). Prefill also reports TFLOP/s.

    python benchmarks/attention.py                 # table to stdout, JSON to benchmarks/results/
    python benchmarks/attention.py --sweep         # also the tuning sweep (configs x splits)
    python benchmarks/plot.py attention          # figures/attention_bandwidth.png from the JSON
    python benchmarks/attention.py --dry-run       # tiny shapes on the CPU (interpreter): plumbing
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import os
import platform
import sys
import tempfile
import time
import traceback

if "--dry-run" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch
import torch.nn.functional as F
import triton
import triton.testing

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from minipaged.attention import triton_kernels as tk  # noqa: E402
from minipaged.attention.metadata import AttentionMetadata  # noqa: E402
from minipaged.attention.triton_backend import TritonBackend  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE, DTYPE = 16, 8, 128, 16, torch.bfloat16
DEFAULT_OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "attention_h200.json")
PEAK_TBS = 4.3  # the brief's H200 reference; a device-to-device copy measures ~4.27 TB/s
DECODE_BATCHES = [1, 16, 64, 256]
DECODE_CONTEXTS = [512, 4096, 16384]
PREFILL = [  # (name, sequences, new tokens per sequence, cached tokens per sequence)
    ("1x512", 1, 512, 0),
    ("1x2048", 1, 2048, 0),
    ("1x8192", 1, 8192, 0),
    ("8x1024", 8, 1024, 0),
    ("chunk 512 on 3584", 1, 512, 3584),
]
FLEX_DECODE = {(1, 4096), (16, 4096), (64, 512), (64, 4096), (64, 16384)}
FLEX_PREFILL = {"1x2048", "1x8192"}


# ------------------------------------------------------------------------------------ timing
def timeit(fns, device, rep_ms=100, graph=True) -> float:
    """Median ms per call: CUDA-graph replays under do_bench (L2 flushed before each replay).

    `fns` is a list of calls on distinct copies of the problem: the graph runs them back to back
    (as a decode step runs its layers) and the time is divided by their number. With one fn this
    is a single cold call, graph launch and all.
    """
    if callable(fns):
        fns = [fns]

    def run_all():
        for f in fns:
            f()
    run_all()  # compile / warm up
    if device.type != "cuda":  # dry run: plumbing only, the interpreter's time means nothing
        t = time.perf_counter()
        run_all()
        return (time.perf_counter() - t) * 1e3 / len(fns)
    torch.cuda.synchronize()
    run = run_all
    if graph:
        try:
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                run_all()
            torch.cuda.current_stream().wait_stream(s)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                run_all()
            run = g.replay
        except Exception as e:  # noqa: BLE001
            print(f"    (no CUDA graph: {type(e).__name__}: {e}; timing eager calls)")
            torch.cuda.synchronize()
    ms = triton.testing.do_bench(run, warmup=25, rep=rep_ms, return_mode="median")
    return float(ms) / len(fns)


def copies_for(nbytes: int) -> int:
    """Distinct copies so that back-to-back calls read >= 256 MB (4x the 60 MB L2) from DRAM."""
    return min(64, max(1, math.ceil(256e6 / nbytes)))


def timing_floor(device) -> dict:
    """What the method itself costs: one tiny kernel, cold and back to back."""
    if device.type != "cuda":
        return {}
    xs = [torch.zeros(1, device=device) for _ in range(16)]
    fns = [x.add_ for x in xs]
    return {"single_us": timeit([lambda: xs[0].add_(1)], device) * 1e3,
            "b2b_us": timeit([lambda x=x: x.add_(1) for x in xs], device) * 1e3}


def copy_bandwidth(device) -> float:
    """TB/s of a 4 GiB device-to-device copy (bytes read + written)."""
    if device.type != "cuda":
        return float("nan")
    a = torch.empty(1 << 31, dtype=torch.int16, device=device)
    b = torch.empty_like(a)
    ms = timeit([lambda: b.copy_(a)], device, graph=False)
    del a, b
    return 2 * (1 << 32) / ms / 1e9


# -------------------------------------------------------------------------------- problems
class Problem:
    """Same K/V twice: contiguous (batch, kv_heads, ctx, dim) and paged with shuffled blocks."""

    def __init__(self, batch, new_tokens, cached, device, seed=0):
        torch.manual_seed(seed)
        ctx = new_tokens + cached
        self.batch, self.new, self.ctx = batch, new_tokens, ctx
        self.q = torch.randn(batch, HEADS, new_tokens, HEAD_DIM, device=device, dtype=DTYPE)
        self.k = torch.randn(batch, KV_HEADS, ctx, HEAD_DIM, device=device, dtype=DTYPE)
        self.v = torch.randn(batch, KV_HEADS, ctx, HEAD_DIM, device=device, dtype=DTYPE)
        blocks_per_seq = triton.cdiv(ctx, BLOCK_SIZE)
        num_blocks = batch * blocks_per_seq
        tables = torch.randperm(num_blocks, device=device).view(batch, blocks_per_seq)
        self.block_tables = tables.to(torch.int32)
        shape = (num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
        self.k_cache = torch.empty(shape, device=device, dtype=DTYPE)
        self.v_cache = torch.empty(shape, device=device, dtype=DTYPE)
        pos = torch.arange(ctx, device=device)
        for b in range(batch):  # one sequence at a time keeps the temporaries small
            slots = tables[b, pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE
            self.k_cache.view(-1, KV_HEADS, HEAD_DIM)[slots] = self.k[b].transpose(0, 1)
            self.v_cache.view(-1, KV_HEADS, HEAD_DIM)[slots] = self.v[b].transpose(0, 1)
        # the flat (num_tokens, heads, dim) queries of an engine step
        self.q_flat = self.q.transpose(1, 2).reshape(batch * new_tokens, HEADS, HEAD_DIM).contiguous()
        qlens, ctxs = [new_tokens] * batch, [ctx] * batch
        cu = torch.arange(batch + 1, device=device, dtype=torch.int32) * new_tokens
        self.metadata = AttentionMetadata(
            slot_mapping=torch.full((batch * new_tokens,), -1, device=device),
            block_tables=self.block_tables,
            context_lens=torch.full((batch,), ctx, device=device, dtype=torch.int32),
            cu_seqlens_q=cu, query_lens=qlens, context_lens_host=ctxs,
            max_query_len=new_tokens, max_context_len=ctx, block_size=BLOCK_SIZE)
        self.scale = 1.0 / math.sqrt(HEAD_DIM)

    def bytes_moved(self) -> int:
        kv = 2 * self.batch * self.ctx * KV_HEADS * HEAD_DIM
        qo = 2 * self.batch * self.new * HEADS * HEAD_DIM
        return (kv + qo) * torch.finfo(DTYPE).bits // 8

    def flops(self) -> int:
        pairs = self.new * self.cached_ctx() + self.new * (self.new + 1) // 2  # causal pairs
        return 4 * self.batch * HEADS * HEAD_DIM * pairs

    def cached_ctx(self) -> int:
        return self.ctx - self.new

    # -- the three contenders ---------------------------------------------------------------
    def triton_fn(self, config=None, num_splits=None):
        """minipaged's path: the backend's plan (config, split count) unless overridden."""
        backend = TritonBackend(num_splits=num_splits)
        backend.prepare(self.metadata)
        launch, = backend._launches(self.metadata.plan, self.q_flat, self.k_cache)  # uniform: one
        config = config or launch.config
        splits = launch.num_splits if num_splits is None else num_splits
        workspace = launch.workspace if splits == launch.num_splits else (
            tk.split_workspace(self.q_flat.shape[0], HEADS, HEAD_DIM, splits, self.q.device)
            if splits > 1 else None)
        out = torch.empty_like(self.q_flat)
        md = self.metadata

        def fn():
            return tk.paged_attention(
                self.q_flat, self.k_cache, self.v_cache, md.block_tables, md.context_lens,
                md.cu_seqlens_q, self.scale, num_seqs=md.num_seqs, max_query_len=md.max_query_len,
                config=config, num_splits=splits, out=out, workspace=workspace)
        fn.config, fn.splits = config, splits
        return fn

    def sdpa_fn(self):
        mask = None
        causal = self.new > 1
        if causal and self.cached_ctx() > 0:
            from torch.nn.attention.bias import causal_lower_right
            mask, causal = causal_lower_right(self.new, self.ctx), False
        return lambda: F.scaled_dot_product_attention(
            self.q, self.k, self.v, attn_mask=mask, is_causal=causal, scale=self.scale,
            enable_gqa=True)

    def flex_fn(self):
        from torch.nn.attention.flex_attention import create_block_mask
        flex = compiled_flex()
        block_mask = None
        if self.new > 1:
            offset = self.cached_ctx()

            def causal(b, h, q_idx, kv_idx):
                return q_idx + offset >= kv_idx
            block_mask = create_block_mask(causal, None, None, self.new, self.ctx,
                                           device=self.q.device)
        return lambda: flex(self.q, self.k, self.v, block_mask=block_mask, scale=self.scale,
                            enable_gqa=True)

    def check(self, out_flat, ref) -> float:
        """Max |triton - SDPA| over all outputs (same inputs, different layouts)."""
        ref = ref.transpose(1, 2).reshape(out_flat.shape)
        return (out_flat.float() - ref.float()).abs().max().item()


_FLEX = []


def compiled_flex():
    if not _FLEX:
        from torch.nn.attention.flex_attention import flex_attention
        _FLEX.append(torch.compile(flex_attention, dynamic=False))
    return _FLEX[0]


def make_problems(batch, new_tokens, cached, device, rotate=True):
    """One problem, plus distinct copies of it when it is small enough to sit in L2."""
    first = Problem(batch, new_tokens, cached, device)
    n = copies_for(first.bytes_moved()) if rotate and device.type == "cuda" else 1
    return [first] + [Problem(batch, new_tokens, cached, device, seed=i) for i in range(1, n)]


def measure(problems, kind, device, use_flex, rep_ms=100) -> dict:
    """Each contender: one cold call, and back-to-back calls over distinct copies (decode)."""
    problem = problems[0]
    row = {"kind": kind, "batch": problem.batch, "new_tokens": problem.new, "context": problem.ctx,
           "bytes": problem.bytes_moved(), "flops": problem.flops()}
    fn = problem.triton_fn()
    row["triton_config"] = dataclasses.asdict(fn.config)
    row["triton_splits"] = fn.splits
    row["copies"] = len(problems)
    contenders = [("triton", lambda p: p.triton_fn()), ("sdpa", lambda p: p.sdpa_fn())]
    if use_flex:
        contenders.append(("flex", lambda p: p.flex_fn()))
    for name, make in contenders:
        try:
            t0 = time.perf_counter()
            fns = [make(p) for p in problems]
            ms = timeit(fns[:1], device, rep_ms=rep_ms)
            row[f"{name}_ms"] = ms
            row[f"{name}_tbs"] = problem.bytes_moved() / ms / 1e9
            row[f"{name}_tflops"] = problem.flops() / ms / 1e9
            if kind == "decode":
                ms = timeit(fns, device, rep_ms=rep_ms) if len(fns) > 1 else ms
                row[f"{name}_b2b_ms"] = ms
                row[f"{name}_b2b_tbs"] = problem.bytes_moved() / ms / 1e9
            row[f"{name}_wall_s"] = round(time.perf_counter() - t0, 1)
        except Exception as e:  # noqa: BLE001
            row[f"{name}_error"] = f"{type(e).__name__}: {str(e)[:300]}"
            print(f"    {name} failed: {row[f'{name}_error']}")
    try:
        row["max_abs_err_vs_sdpa"] = problem.check(fn(), problem.sdpa_fn()())
    except Exception as e:  # noqa: BLE001
        row["check_error"] = repr(e)[:300]
    return row


# ---------------------------------------------------------------------------------- sweep
def sweep(device, rep_ms=40) -> dict:
    """How the defaults were chosen. Decode: tile configs at three shapes, then split counts at
    every shape (back to back, over distinct copies). Prefill: tile configs on three prompts.
    Prints the best of each; returns everything."""
    results = {"decode_configs": [], "decode_splits": [], "prefill_configs": []}
    cfgs = [tk.KernelConfig(16, bn, w, st) for bn in (32, 64, 128) for w in (2, 4, 8)
            for st in (2, 3, 4) if not (bn == 128 and st == 4)]
    for (b, ctx, splits) in [(64, 4096, 1), (16, 4096, 4), (1, 4096, 32)]:
        ps = make_problems(b, 1, ctx - 1, device)
        best = None
        for cfg in cfgs:
            ms = timeit([p.triton_fn(cfg, splits) for p in ps], device, rep_ms=rep_ms)
            tbs = ps[0].bytes_moved() / ms / 1e9
            results["decode_configs"].append({"batch": b, "context": ctx, "splits": splits,
                                              **dataclasses.asdict(cfg), "ms": ms, "tbs": tbs})
            if best is None or tbs > best[1]:
                best = (cfg, tbs)
        print(f"  decode {b}x{ctx} splits={splits}: best {best[0]} {best[1]:.2f} TB/s", flush=True)
        del ps
    for b in DECODE_BATCHES:
        for ctx in DECODE_CONTEXTS:
            ps = make_problems(b, 1, ctx - 1, device)
            line = []
            for cfg in (tk.KernelConfig(16, 64, 2, 3), tk.KernelConfig(16, 32, 2, 3)):
                for splits in (1, 2, 4, 8, 16, 32, 64):
                    if splits > 1 and triton.cdiv(ctx, cfg.block_n) < splits:
                        continue
                    if b * KV_HEADS * splits > 132 * 64:
                        continue
                    ms = timeit([p.triton_fn(cfg, splits) for p in ps], device, rep_ms=rep_ms)
                    tbs = ps[0].bytes_moved() / ms / 1e9
                    results["decode_splits"].append({"batch": b, "context": ctx, "splits": splits,
                                                     **dataclasses.asdict(cfg), "ms": ms, "tbs": tbs})
                    line.append(f"{cfg.block_n}/{splits}:{tbs:.2f}")
            print(f"  decode {b}x{ctx} (block_n/splits:TB/s) " + " ".join(line), flush=True)
            del ps
            torch.cuda.empty_cache()
    pcfgs = [tk.KernelConfig(bm, bn, w, st) for bm, bn, w, st in [
        (128, 128, 8, 3), (128, 128, 8, 2), (128, 64, 8, 3), (128, 64, 4, 3), (64, 128, 4, 2),
        (64, 128, 4, 3), (64, 64, 4, 3), (64, 64, 2, 3), (32, 64, 2, 3), (32, 128, 4, 2)]]
    for name, b, new, cached in (PREFILL[1], PREFILL[3], PREFILL[4]):
        p = Problem(b, new, cached, device)
        best = None
        for cfg in pcfgs:
            for splits in (1, 2, 4):
                ms = timeit(p.triton_fn(cfg, splits), device, rep_ms=rep_ms)
                tf = p.flops() / ms / 1e9
                results["prefill_configs"].append({"name": name, **dataclasses.asdict(cfg),
                                                   "splits": splits, "ms": ms, "tflops": tf})
                if best is None or tf > best[1]:
                    best = (cfg, tf, splits)
        print(f"  prefill {name}: best {best[0]} splits {best[2]} {best[1]:.0f} TFLOP/s", flush=True)
        del p
    return results


# ---------------------------------------------------------------------------------- report
def markdown(rows, copy_tbs) -> str:
    def tbs(r, name):
        if f"{name}_b2b_tbs" not in r:
            return "-"
        return f"{r[f'{name}_b2b_tbs']:.2f} / {r[f'{name}_tbs']:.2f}"

    lines = [f"Decode, bf16, 16 q / 8 KV heads x 128, KV block size 16. TB/s of K+V+Q+O moved: "
             f"back to back over distinct copies / one cold call (share of {PEAK_TBS} TB/s for "
             f"the first; copy measured {copy_tbs:.2f} TB/s).",
             "",
             "| batch x context | Triton paged TB/s | % of 4.3 | splits | SDPA contiguous TB/s "
             "| Flex contiguous TB/s | Triton / SDPA | Triton us |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["kind"] != "decode":
            continue
        share = f"{r['triton_b2b_tbs'] / PEAK_TBS:.0%}" if "triton_b2b_tbs" in r else "-"
        ratio = (f"{r['sdpa_b2b_ms'] / r['triton_b2b_ms']:.2f}x"
                 if "sdpa_b2b_ms" in r and "triton_b2b_ms" in r else "-")
        us = f"{r['triton_b2b_ms'] * 1e3:.1f}" if "triton_b2b_ms" in r else "-"
        lines.append(f"| {r['batch']} x {r['context']} | {tbs(r, 'triton')} | {share} | "
                     f"{r['triton_splits']} | {tbs(r, 'sdpa')} | {tbs(r, 'flex')} | {ratio} | {us} |")
    lines += ["", "Prefill, causal (TFLOP/s counts the unmasked pairs only)", "",
              "| prompt | Triton us | Triton TFLOP/s | splits | SDPA us | SDPA TFLOP/s "
              "| Flex us | Flex TFLOP/s | Triton / SDPA |",
              "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["kind"] != "prefill":
            continue
        cells = []
        for name in ("triton", "sdpa", "flex"):
            if f"{name}_ms" in r:
                cells += [f"{r[f'{name}_ms'] * 1e3:.0f}", f"{r[f'{name}_tflops']:.0f}"]
            else:
                cells += ["-", "-"]
            if name == "triton":
                cells.append(str(r["triton_splits"]))
        ratio = (f"{r['sdpa_ms'] / r['triton_ms']:.2f}x" if "sdpa_ms" in r and "triton_ms" in r
                 else "-")
        lines.append(f"| {r['name']} | " + " | ".join(cells) + f" | {ratio} |")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=DEFAULT_OUT)
    ap.add_argument("--sweep", action="store_true", help="also run the tuning sweep")
    ap.add_argument("--sweep-only", action="store_true")
    ap.add_argument("--sweep-rep-ms", type=float, default=40)
    ap.add_argument("--no-flex", action="store_true", help="skip FlexAttention (slow to compile)")
    ap.add_argument("--flex-budget-s", type=float, default=240,
                    help="stop compiling FlexAttention variants after this many seconds")
    ap.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU interpreter")
    args = ap.parse_args()
    device = torch.device("cpu" if args.dry_run else "cuda")
    global DECODE_BATCHES, DECODE_CONTEXTS, PREFILL, FLEX_DECODE
    if args.dry_run:
        if args.out == DEFAULT_OUT:  # plumbing only: keep the committed H200 results
            args.out = os.path.join(tempfile.gettempdir(), "attention_dry_run.json")
        DECODE_BATCHES, DECODE_CONTEXTS = [1, 2], [32, 100]
        PREFILL = [("1x40", 1, 40, 0), ("chunk 16 on 48", 1, 16, 48)]
        FLEX_DECODE = set()
    started = time.time()
    result = {
        "gpu": torch.cuda.get_device_name() if device.type == "cuda" else "cpu (interpreter)",
        "torch": torch.__version__, "triton": triton.__version__, "python": platform.python_version(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "shapes": {"heads": HEADS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM,
                   "block_size": BLOCK_SIZE, "dtype": str(DTYPE)},
        "peak_tbs": PEAK_TBS,
        "timing": "CUDA graph replays, triton.testing.do_bench median, L2 flushed before each",
    }
    result["copy_tbs"] = copy_bandwidth(device)
    result["timing_floor"] = timing_floor(device)
    print(f"{result['gpu']}: copy {result['copy_tbs']:.2f} TB/s, timing floor "
          f"{result['timing_floor']}", flush=True)
    if args.sweep or args.sweep_only:
        result["sweep"] = sweep(device, rep_ms=args.sweep_rep_ms)
        with open(args.out + ".sweep.json", "w") as f:
            json.dump(result, f, indent=1)
        print(f"sweep done at {time.time() - started:.0f}s", flush=True)
    rows = result["rows"] = []

    def save():  # after every shape: a run cut short still leaves its numbers
        result["wall_s"] = round(time.time() - started, 1)
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)

    save()
    flex_budget = [args.flex_budget_s]

    def use_flex(wanted):
        return wanted and not args.no_flex and flex_budget[0] > 0

    def spend_flex(row):
        flex_budget[0] -= row.get("flex_wall_s", 0)

    if not args.sweep_only:
        for b in DECODE_BATCHES:
            for ctx in DECODE_CONTEXTS:
                p = make_problems(b, 1, ctx - 1, device)
                row = measure(p, "decode", device, use_flex=use_flex((b, ctx) in FLEX_DECODE))
                spend_flex(row)
                rows.append(row)
                save()
                print(f"decode {b}x{ctx}: " + ", ".join(
                    f"{k}={v:.3f}" for k, v in row.items() if k.endswith("_tbs")), flush=True)
                del p
                if device.type == "cuda":
                    torch.cuda.empty_cache()
        for name, b, new, cached in PREFILL:
            p = [Problem(b, new, cached, device)]
            row = measure(p, "prefill", device, use_flex=use_flex(name in FLEX_PREFILL))
            spend_flex(row)
            row["name"] = name
            rows.append(row)
            save()
            print(f"prefill {name}: " + ", ".join(
                f"{k}={v:.1f}" for k, v in row.items() if k.endswith("_tflops")), flush=True)
            del p
    save()
    if rows:
        print()
        print(markdown(rows, result["copy_tbs"]))
    print(f"\nwrote {args.out} ({result['wall_s']} s)")


if __name__ == "__main__":
    main()
