"""benchmarks/vs_vllm.py and its side process: the shared workloads, one minipaged side on the
CPU, and the paired summary (vLLM itself runs only on the GPU machine)."""
from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import vs_vllm  # noqa: E402


def test_workloads_are_nano_vllms_draw_and_fit_the_context():
    spec = vs_vllm.workloads(["nanovllm", "sharegpt", "one_stream"], 4096)
    nano, share, one = spec["workloads"]
    random.seed(0)  # nano-vllm's bench.py, as the vLLM kit's bench draws it
    first = [random.randint(0, 10000) for _ in range(random.randint(100, 1024))]
    assert nano["prompts"][0] == first and len(nano["prompts"]) == 256
    assert all(100 <= m <= 1024 for m in nano["max_tokens"])
    assert len(share["prompts"]) == 512
    assert all(len(p) + m <= 4096 for p, m in zip(share["prompts"], share["max_tokens"]))
    assert [len(p) for p in one["prompts"]] == [128] and one["max_tokens"] == [1024]
    assert one["repeats"] == 3 and nano["repeats"] == 1


def test_minipaged_side_times_every_workload_and_checks_its_tokens(tmp_path):
    spec = {"max_model_len": 256, "workloads": [
        {"name": "nanovllm", "prompts": [[1, 5, 9, 30], [1, 7]], "max_tokens": [6, 3],
         "repeats": 1},
        {"name": "one_stream", "prompts": [[1, 8, 9]], "max_tokens": [5], "repeats": 3}]}
    wl = tmp_path / "w.json"
    wl.write_text(json.dumps(spec))
    out = tmp_path / "side.json"
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "lib" / "peer_side.py"),
                    "--engine", "minipaged", "--model", "stories260K", "--workloads", str(wl),
                    "--out", str(out)], check=True, cwd=ROOT, timeout=300)
    side = json.loads(out.read_text())
    assert side["config"]["engine"] == "minipaged" and side["config"]["block_size"] >= 1
    assert side["warmup"]["output_tokens"] == 9
    assert side["results"]["nanovllm"]["output_tokens"] == 9
    one = side["results"]["one_stream"]
    assert one["output_tokens"] == 5 and len(one["runs"]) == 3
    assert one["ms_per_token"] == pytest.approx(1e3 * one["seconds"] / 5, rel=1e-3)
    # each run's own steps, from the engine's trace: one sequence of 3 prompt + 5 output tokens
    assert one["steps"]["steps"] == 5 and one["steps"]["max_ms"] >= one["steps"]["median_ms"] > 0
    assert side["results"]["nanovllm"]["steps"]["steps"] == 6  # the longer request's 6 tokens


def test_summary_pairs_each_rounds_sides():
    def side(tps):
        return {"results": {"nanovllm": {"tok_per_s": tps}}}
    rounds = [{"vllm": side(100.0), "minipaged": side(110.0)},
              {"vllm": side(200.0), "minipaged": side(180.0)},
              {"vllm": side(100.0), "minipaged": side(105.0)}]
    s = vs_vllm.summarize(rounds, ["nanovllm"])["nanovllm"]
    assert s["paired_ratios"] == [1.1, 0.9, 1.05] and s["median_ratio"] == 1.05


def test_vllm_side_gets_an_absolute_model_folder(tmp_path, monkeypatch):
    """vLLM's side runs from a clean working directory, so a relative --vllm-models must reach
    it resolved (a relative one made vLLM read the folder name as a Hub repo id)."""
    seen = []

    def fake_side(engine, model, wl_file, vllm_env, python):
        seen.append((engine, model))
        return {"results": {"one_stream": {"tok_per_s": 1.0, "ms_per_token": 1.0}}}
    monkeypatch.setattr(vs_vllm, "run_side", fake_side)
    monkeypatch.chdir(tmp_path)
    vs_vllm.main(["--vllm-env", "env.sh", "--vllm-models", "peer", "--models", "qwen3-0.6b",
                  "--workloads", "one_stream", "--rounds", "1", "--out", str(tmp_path / "o.json")])
    assert ("vllm", str(tmp_path / "peer" / "qwen3-0.6b-dummy")) in seen
    assert ("minipaged", "dummy:qwen3-0.6b") in seen
