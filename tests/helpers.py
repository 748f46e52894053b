"""Shared helpers for the tests: tiny random HF models of each family saved to disk, the
stories260K reference ids, and the set-up of the Triton test modules."""
from __future__ import annotations

import os

import pytest
import torch

# From stories260K's SOURCE.md: "Once upon a time", greedy, 40 new tokens (prompt included).
STORIES_EXPECTED = [1, 403, 407, 261, 378, 432, 383, 286, 261, 376, 298, 315, 421, 395, 317, 426,
                    338, 401, 396, 267, 337, 410, 408, 419, 292, 411, 322, 265, 282, 295, 433, 426,
                    385, 328, 432, 358, 394, 261, 370, 432, 352, 266, 268, 388, 426]


# The Triton interpreter's loop bounds warn on numpy < 2.4, harmlessly: `pytestmark = ...`.
IGNORE_INTERPRETER_WARNINGS = pytest.mark.filterwarnings(
    "ignore:Conversion of an array with ndim > 0:DeprecationWarning")


def store_and_attend(backend, q, k, v, k_cache, v_cache, metadata, scale: float) -> torch.Tensor:
    """One layer's attention through `backend`: the step's K/V stored (`store_kv`), then the
    queries attended over the cache (`attend`), as `LlamaAttention` calls them."""
    backend.store_kv(k, v, k_cache, v_cache, metadata)
    return backend.attend(q, k_cache, v_cache, metadata, scale)


def triton_device() -> str:
    """Where a Triton test module runs its kernels: "cuda" on a GPU, else "cpu" under the
    interpreter. Call it at module level, before importing any kernel: it skips the whole module
    without `triton`, or on the CPU without TRITON_INTERPRET=1 (tests/conftest.py sets it)."""
    pytest.importorskip("triton")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("no GPU and TRITON_INTERPRET is not set", allow_module_level=True)
    return device


def make_tiny_hf_model(family: str, path, seed: int = 0, dtype=torch.float64):
    """A random-weight Llama / Qwen2 / Qwen3 / Mistral model with GQA, saved as an HF folder."""
    from transformers import (LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM,
                              Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM)
    common = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
                  initializer_range=0.2)
    cls, cfg = {
        "llama": (LlamaForCausalLM, lambda: LlamaConfig(**common, rope_theta=10000.0)),
        "mistral": (MistralForCausalLM, lambda: MistralConfig(**common, sliding_window=None)),
        "qwen2": (Qwen2ForCausalLM, lambda: Qwen2Config(**common)),
        "qwen3": (Qwen3ForCausalLM, lambda: Qwen3Config(**common, head_dim=16)),
    }[family]
    torch.manual_seed(seed)
    model = cls(cfg()).to(dtype).eval()
    if family == "qwen2":  # make the q/k/v biases matter
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.5)
    if family == "qwen3":  # and the q/k norms
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.q_norm.weight.uniform_(0.5, 1.5)
                layer.self_attn.k_norm.weight.uniform_(0.5, 1.5)
    model.save_pretrained(str(path))
    return model


def hf_greedy(model, prompts: list[list[int]], max_new_tokens: int | list[int]) -> list[list[int]]:
    """Reference: HF generate(do_sample=False) one prompt at a time, EOS ignored (like ignore_eos)."""
    if isinstance(max_new_tokens, int):
        max_new_tokens = [max_new_tokens] * len(prompts)
    outs = []
    with torch.no_grad():
        for ids, n in zip(prompts, max_new_tokens):
            x = torch.tensor([ids])
            # eos_token_id=-1: never stop early, and (unlike min_new_tokens) never ban EOS either
            y = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n,
                               do_sample=False, pad_token_id=0, eos_token_id=-1)
            outs.append(y[0, len(ids):].tolist())
    return outs


def exercise_cell(notebook) -> str:
    """The source of a lesson's graded exercise cell (the one holding `ANSWER = None`), after
    checking the notebook is committed as nbformat 4.5 with cell ids, executed by `make lessons`
    (each code cell's output stored with its source's hash; tests/test_lessons_outputs.py checks
    the hashes)."""
    import json
    from pathlib import Path
    nb = json.loads(Path(notebook).read_text())
    assert (nb["nbformat"], nb["nbformat_minor"]) == (4, 5)
    assert all("id" in c for c in nb["cells"])
    assert all("minipaged" in c["metadata"] for c in nb["cells"] if c["cell_type"] == "code")
    (cell,) = [c for c in nb["cells"] if "ANSWER = None" in "".join(c["source"])]
    return "".join(cell["source"])

