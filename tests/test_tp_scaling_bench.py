"""benchmarks/tp_scaling.py and lib/tp_busbw.py: nccl-tests' busbw formula, the message sizes of a
decode step, the profiler split, and the JSON of a tiny run on the CPU (gloo, two ranks)."""
import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path[:0] = [str(BENCH), str(BENCH / "lib")]

import plot  # noqa: E402
import tp_busbw  # noqa: E402
import tp_scaling  # noqa: E402


def test_busbw_is_nccl_tests_definition():
    # nccl-tests (doc/PERFORMANCE.md): busbw = algbw * 2 (N-1) / N; algbw = bytes / time
    gib = 1 << 30
    assert tp_busbw.bus_bandwidth(gib, 0.01, 2) == pytest.approx(gib / 0.01)  # 2: factor 1
    assert tp_busbw.bus_bandwidth(gib, 0.01, 4) == pytest.approx(1.5 * gib / 0.01)
    assert tp_busbw.bus_bandwidth(gib, 0.01, 8) == pytest.approx(1.75 * gib / 0.01)
    assert tp_busbw.bus_bandwidth(gib, 0.01, 1) == 0.0  # one rank moves nothing
    with pytest.raises(ValueError, match="seconds=0"):
        tp_busbw.bus_bandwidth(gib, 0.0, 2)
    with pytest.raises(ValueError, match="world_size=0"):
        tp_busbw.bus_bandwidth(gib, 0.01, 0)
    with pytest.raises(ValueError, match="at least 2 ranks"):
        tp_busbw.measure(1, [1024], device="cpu")


def test_decode_message_sizes_and_sweep():
    sizes = tp_busbw.decode_message_sizes([1024, 4096], 2)
    assert sizes[0] == 1 * 1024 * 2 and sizes[-1] == 256 * 4096 * 2
    assert 4 * 1024 * 2 in sizes and len(sizes) == len(set(sizes))  # 4 x 1024 == 1 x 4096
    assert len(sizes) == 9 + 9 - 7  # the 7 sizes 1024 and 4096 share are there once
    assert tp_busbw.sweep_sizes(256 << 20) == [1024 << k for k in range(19)]


def test_split_events_counts_nccl_kernels_on_cuda_and_gloo_ops_on_cpu():
    ev = [("ncclDevKernel_AllReduce_Sum_bf16_RING_LL", True, 30.0),
          ("ncclDevKernel_AllReduce_Sum_bf16_RING_LL", True, 10.0),
          ("ncclDevKernel_Broadcast_RING_LL", True, 4.0),
          ("ampere_bf16_gemm", True, 100.0), ("triton_paged_attention", True, 60.0),
          ("cudaGraphLaunch", False, 500.0), ("aten::mm", False, 70.0)]
    s = tp_scaling.split_events(ev, wall_s=0.0004, steps=2, cuda=True)
    assert s == {"step_ms": 0.2, "compute_ms": 0.08, "all_reduce_ms": 0.02,
                 "other_comm_ms": 0.002, "all_reduces_per_step": 1.0}
    cpu = [("gloo:all_reduce", False, 300.0), ("gloo:broadcast", False, 100.0),
           ("c10d::allreduce_", False, 200.0), ("aten::mm", False, 50.0)]
    s = tp_scaling.split_events(cpu, wall_s=0.002, steps=1, cuda=False)
    assert s["all_reduce_ms"] == 0.3 and s["other_comm_ms"] == 0.1
    assert s["compute_ms"] == pytest.approx(1.6)  # the step's wall minus its collectives


def test_default_sizes_capped_at_the_gpus():
    assert tp_scaling.default_sizes("cuda", 2) == [1, 2]
    assert tp_scaling.default_sizes("cuda", 8) == [1, 2, 4]
    assert tp_scaling.default_sizes("cpu", 0) == [1, 2, 4]


def test_tiny_cpu_run_writes_every_phase(tmp_path):
    out = tmp_path / "tp.json"
    tp_scaling.main(["--device", "cpu", "--models", "stories260K", "--sizes", "1,2",
                     "--num-requests", "4", "--split-batches", "2", "--split-steps", "2",
                     "--parity", "--parity-tokens", "8", "--busbw-iters", "2",
                     "--sweep-max-mib", "0", "--out", str(out)])
    rep = json.loads(out.read_text())
    assert [(r["model"], r["tp"]) for r in rep["throughput"]] == [("stories260K", 1),
                                                                  ("stories260K", 2)]
    one, two = rep["throughput"]
    assert one["output_tokens"] == two["output_tokens"] > 0 and one["itl_ms"]["p99"] is not None
    assert one["warmup"]["output_tokens"] == one["output_tokens"]  # warmed on the same shapes
    s1, s2 = one["splits"][0], two["splits"][0]
    assert s1["batch"] == s2["batch"] == 2 and s1["running"] == 2
    assert s1["all_reduces_per_step"] == 0 and s1["all_reduce_ms"] == 0
    assert s2["all_reduces_per_step"] == s2["all_reduces_expected"] == 1 + 2 * two["num_layers"]
    assert s1["all_reduces_expected"] == 0  # embedding + 2 per layer at N > 1
    assert s2["all_reduce_ms"] > 0 and s2["all_reduce_at_busbw_ms"] > 0
    assert [(p["tp"], p["equal_to_tp1"]) for p in rep["parity"]] == [(1, True), (2, True)]
    sizes = [b["bytes"] for b in rep["busbw"]]
    assert sizes == tp_busbw.decode_message_sizes([64], 4)  # stories260K, float32
    assert all(b["tp"] == 2 and b["busbw_gbps"] == b["algbw_gbps"] for b in rep["busbw"])
    # --merge keeps the other phases; the figure draws from the JSON
    tp_scaling.main(["--device", "cpu", "--models", "stories260K", "--sizes", "2",
                     "--phases", "busbw", "--busbw-iters", "1", "--sweep-max-mib", "0",
                     "--merge", "--out", str(out)])
    rep = json.loads(out.read_text())
    assert len(rep["throughput"]) == 2 and len(rep["parity"]) == 2
    plot.main(["tp_scaling", "--json", str(out), "--out", str(tmp_path / "tp.png")])
    assert (tmp_path / "tp.png").stat().st_size > 10_000
