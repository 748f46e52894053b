"""Lesson 11's helpers and its graded exercise: minipaged/lessons/adapters.py (LoRA in torch),
minipaged/lessons/quantization.py (text_logits), notebooks/11_adapters_and_quantization.ipynb."""
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import pytest  # noqa: E402
import torch  # noqa: E402

from minipaged import LLM, SamplingParams  # noqa: E402
from minipaged.lessons import adapters  # noqa: E402
from minipaged.lessons.quantization import text_logits  # noqa: E402

NOTEBOOK = (Path(__file__).resolve().parents[1] / "notebooks"
            / "11_adapters_and_quantization.ipynb")


def _batch(n_adapters, tokens=24, d=32, rank=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    x, w = torch.randn(tokens, d, generator=g), torch.randn(d + 8, d, generator=g)
    a = torch.randn(n_adapters + 1, rank, d, generator=g)
    b = torch.randn(n_adapters + 1, d + 8, rank, generator=g)
    a[0], b[0] = 0, 0
    idx = torch.randint(0, n_adapters + 1, (tokens,), generator=g)
    return x, w, a, b, idx


@pytest.mark.parametrize("n", [1, 3, 7])
def test_loop_and_gathered_equal_each_tokens_own_lora(n):
    x, w, a, b, idx = _batch(n)
    want = torch.stack([adapters.lora_forward(x[t:t + 1], w, a[i], b[i], 0.5)[0]
                        for t, i in enumerate(idx.tolist())])  # token by token, the definition
    torch.testing.assert_close(adapters.loop_per_adapter(x, w, a, b, idx, 0.5), want)
    torch.testing.assert_close(adapters.gathered(x, w, a, b, idx, 0.5), want)
    base = idx == 0
    torch.testing.assert_close(want[base], x[base] @ w.t())  # slot 0 adds nothing


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


def _exercise_cell():
    nb = json.loads(NOTEBOOK.read_text())
    assert (nb["nbformat"], nb["nbformat_minor"]) == (4, 5)
    assert all("id" in c for c in nb["cells"])
    assert all(not c.get("outputs") for c in nb["cells"] if c["cell_type"] == "code")
    (cell,) = [c for c in nb["cells"] if "ANSWER = None" in "".join(c["source"])]
    return "".join(cell["source"])


def test_the_graded_exercise_runs_in_ci_and_grades_when_filled():
    src = _exercise_cell()
    from minipaged.models.quantization.fp8 import dequantize, quantize_rowwise
    env = {"torch": torch, "quantize_rowwise": quantize_rowwise, "dequantize": dequantize}
    exec(src, dict(env))  # untouched: runs, grades nothing
    exec(src.replace("ANSWER = None", "ANSWER = 0.125"), dict(env))  # 80 x 0.7 / 448
    for wrong in ("0.123", "0.1125", "0.1375"):  # unrounded, and the e4m3 neighbours 72, 88
        with pytest.raises(AssertionError):
            exec(src.replace("ANSWER = None", f"ANSWER = {wrong}"), dict(env))
