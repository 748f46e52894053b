"""Lesson 11's fp8 helper and its graded exercise: minipaged/lessons/quantization.py
(text_logits), notebooks/11_adapters_and_quantization.ipynb. Its LoRA helpers (lessons/lora.py)
are tested in tests/test_lora.py."""
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import pytest  # noqa: E402
import torch  # noqa: E402

from minipaged import LLM, SamplingParams  # noqa: E402
from minipaged.lessons.quantization import text_logits  # noqa: E402
from tests.helpers import exercise_cell

NOTEBOOK = (Path(__file__).resolve().parents[1] / "notebooks"
            / "11_adapters_and_quantization.ipynb")


def test_text_logits_last_row_is_the_engines_next_token_and_leaves_its_cache_alone():
    llm = LLM("stories260K", device="cpu")
    ids = llm.get_tokenizer()("Once upon a time, there was")["input_ids"]
    before = llm.engine.kv_cache.clone()
    logits = text_logits(llm, ids)
    assert logits.shape == (len(ids), llm.engine.model_config.vocab_size)
    assert torch.equal(llm.engine.kv_cache, before)
    out = llm.generate([ids], SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)[0]
    assert out.outputs[0].token_ids[0] == int(logits[-1].argmax())
    # every earlier row predicts the text's next token as a prefill of that prefix would
    short = text_logits(llm, ids[:4])
    torch.testing.assert_close(short, logits[:4], rtol=1e-5, atol=1e-5)


def test_the_graded_exercise_runs_in_ci_and_grades_when_filled():
    src = exercise_cell(NOTEBOOK)
    from minipaged.models.quantization.fp8 import dequantize, quantize_rowwise
    env = {"torch": torch, "quantize_rowwise": quantize_rowwise, "dequantize": dequantize}
    exec(src, dict(env))  # untouched: runs, grades nothing
    exec(src.replace("ANSWER = None", "ANSWER = 0.125"), dict(env))  # 80 x 0.7 / 448
    for wrong in ("0.123", "0.1125", "0.1375"):  # unrounded, and the e4m3 neighbours 72, 88
        with pytest.raises(AssertionError):
            exec(src.replace("ANSWER = None", f"ANSWER = {wrong}"), dict(env))
