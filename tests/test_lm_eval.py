"""lm-evaluation-harness as a real client of `minipaged serve` (docs/guides/evaluation.md).

lm-eval's `local-completions` model runs the repository's two tasks (evals/: a multiple-choice
task scored by log-likelihood, a generate-until task) against the server, and its `hf` backend
runs them on the same model with transformers. The scores must be equal, and so must each
item's log-likelihoods (within 1e-4), greedy flags and generated text. Skipped without lm-eval
(`pip install "lm-eval[api]"`: not in the dev extra, it brings about 750 MB of packages).
"""
from __future__ import annotations

from pathlib import Path

import pytest

lm_eval = pytest.importorskip("lm_eval")

from lm_eval.tasks import TaskManager  # noqa: E402

from minipaged.lessons.server import InProcessServer  # noqa: E402
from minipaged.models.loader import resolve_builtin  # noqa: E402

TASKS = ["tinystories_mc", "tinystories_gen"]
EVALS = Path(__file__).resolve().parents[1] / "evals"


def evaluate(model: str, model_args: str, **kw) -> dict:
    return lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=TASKS,
                                   task_manager=TaskManager(include_path=str(EVALS)),
                                   log_samples=True, **kw)


def test_local_completions_against_serve_equals_hf_backend():
    path = resolve_builtin("stories260K")
    hf = evaluate("hf", f"pretrained={path},dtype=float32,add_bos_token=True", device="cpu",
                  batch_size=1)
    with InProcessServer("stories260K", "--device", "cpu", "--uvicorn-log-level",
                         "warning") as server:
        served = evaluate("local-completions",
                          f"model=stories260K,base_url={server.url}/v1/completions,"
                          f"tokenizer_backend=huggingface,tokenizer={path},add_bos_token=True,"
                          f"num_concurrent=1,max_retries=1")
    for task, metrics in [("tinystories_mc", ["acc,none", "acc_norm,none"]),
                          ("tinystories_gen", ["exact_match,first_word"])]:
        for metric in metrics:
            assert served["results"][task][metric] == hf["results"][task][metric], (task, metric)
    assert 0 < hf["results"]["tinystories_mc"]["acc,none"] < 1  # scores that could differ
    assert 0 < hf["results"]["tinystories_gen"]["exact_match,first_word"] < 1
    # item by item: each choice's log-likelihood and greedy flag; each generation
    for a, b in zip(served["samples"]["tinystories_mc"], hf["samples"]["tinystories_mc"],
                    strict=True):
        for (ll_a, greedy_a), (ll_b, greedy_b) in zip(a["filtered_resps"], b["filtered_resps"],
                                                      strict=True):
            assert ll_a == pytest.approx(ll_b, abs=1e-4) and greedy_a == greedy_b
    for a, b in zip(served["samples"]["tinystories_gen"], hf["samples"]["tinystories_gen"],
                    strict=True):
        assert a["resps"][0][0].strip() == b["resps"][0][0].strip()
