"""The fused Triton kernels of `minipaged/models/triton_ops.py` against torch, and whole models
with `fused_ops=True` against the unfused path.

Without a GPU the kernels run under the Triton interpreter (tests/conftest.py sets
TRITON_INTERPRET=1 before minipaged is imported), so sizes are small; on CUDA the same tests run
the compiled kernels. Cache slots that no token writes hold NaN and must still hold NaN afterwards.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.helpers import IGNORE_INTERPRETER_WARNINGS, STORIES_EXPECTED, make_tiny_hf_model, triton_device

DEVICE = triton_device()  # skips this module where Triton kernels cannot run

from minipaged import LLM, SamplingParams  # noqa: E402
from minipaged.attention.torch_ref import TorchRefBackend  # noqa: E402
from minipaged.attention.triton_backend import TritonBackend  # noqa: E402
from minipaged.models import triton_ops as ops  # noqa: E402
from minipaged.models.loader import load_model, resolve_model  # noqa: E402

pytestmark = IGNORE_INTERPRETER_WARNINGS

# Kernels and references both compute in fp32 and round once, so fp32 agrees to rounding. In
# bf16/fp16 a last-bit difference in a rounded input moves the output by an ulp or two, and the
# interpreter rounds fp32 -> bf16 by truncation (the GPU rounds to nearest even).
TOL = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}
EPS = 1e-6


def randn(g, *shape, dtype=torch.float32):
    return torch.randn(*shape, generator=g).to(dtype).to(DEVICE)


def assert_close(out, ref, dtype):
    torch.testing.assert_close(out.float(), ref.float(), atol=TOL[dtype], rtol=TOL[dtype])


def rms_norm_ref(x, weight):
    """HF's RMSNorm in fp32 (weight applied before rounding), x (..., dim)."""
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * weight.float()


# -------------------------------------------------------------------------------------- norms
@pytest.mark.parametrize("hidden", [96, 1024])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_add_rms_norm_and_rms_norm(hidden, dtype):
    g = torch.Generator().manual_seed(hidden)
    x, residual = randn(g, 5, hidden, dtype=dtype), randn(g, 5, hidden, dtype=dtype)
    weight = (torch.rand(hidden, generator=g) + 0.5).to(dtype).to(DEVICE)

    out, new_residual = ops.fused_add_rms_norm(x, residual, weight, EPS)
    expected_residual = x + residual  # torch rounds the sum to `dtype`, like HF
    if dtype == torch.float32 or DEVICE == "cuda":  # the interpreter truncates fp32 -> bf16
        assert torch.equal(new_residual, expected_residual)
    assert_close(new_residual, expected_residual, dtype)
    assert out.dtype == dtype and out.shape == x.shape
    assert_close(out, rms_norm_ref(expected_residual, weight), dtype)
    # the inputs are left alone
    assert torch.equal(x + residual, expected_residual)

    assert_close(ops.rms_norm(x, weight, EPS), rms_norm_ref(x, weight), dtype)


@pytest.mark.parametrize("intermediate", [96, 1500])  # 1500: two column blocks, the last masked
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_and_mul(intermediate, dtype):
    g = torch.Generator().manual_seed(intermediate)
    x = randn(g, 3, 2 * intermediate, dtype=dtype)
    gate, up = x.float().chunk(2, dim=-1)
    out = ops.silu_and_mul(x)
    assert out.dtype == dtype and out.shape == (3, intermediate)
    assert_close(out, F.silu(gate) * up, dtype)


# ------------------------------------------------------------------- q/k norm + RoPE + store
def rope_tables(head_dim, max_positions=64):
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    freqs = torch.outer(torch.arange(max_positions).float(), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)  # (max_positions, head_dim), halves equal
    return emb.cos().to(DEVICE), emb.sin().to(DEVICE)


def qkv_rope_reference(qkv, positions, cos, sin, q_norm, k_norm, num_heads, num_kv_heads, head_dim):
    """HF's per-head norm and `x * cos + rotate_half(x) * sin`, in fp32."""
    n = qkv.shape[0]
    q, k, v = qkv.float().split([num_heads * head_dim, num_kv_heads * head_dim,
                                 num_kv_heads * head_dim], dim=-1)
    q, k = q.view(n, num_heads, head_dim), k.view(n, num_kv_heads, head_dim)
    if q_norm is not None:
        q, k = rms_norm_ref(q, q_norm), rms_norm_ref(k, k_norm)
    c, s = cos[positions][:, None], sin[positions][:, None]  # (num_tokens, 1, head_dim)

    def rotate_half(x):
        return torch.cat((-x[..., head_dim // 2:], x[..., :head_dim // 2]), dim=-1)

    return q * c + rotate_half(q) * s, k * c + rotate_half(k) * s, v.view(n, num_kv_heads, head_dim)


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim,qk_norm,dtype", [
    (8, 4, 8, False, torch.float32),  # stories260K
    (4, 2, 16, True, torch.float32),  # the tiny Qwen3 below
    (6, 2, 64, True, torch.bfloat16),  # head counts that are not powers of two, group 3
    (16, 8, 128, True, torch.bfloat16),  # Qwen3-0.6B
    (16, 8, 128, False, torch.float32),
    (2, 1, 64, True, torch.float16),
])
@pytest.mark.parametrize("head_major", [False, True], ids=["token-major", "head-major"])
def test_qkv_rope_store(num_heads, num_kv_heads, head_dim, qk_norm, dtype, head_major):
    g = torch.Generator().manual_seed(head_dim + num_heads)
    block_size, num_blocks = 4, 6
    slot_mapping = torch.tensor([5, -1, 17, 0, 22, -1], device=DEVICE)  # shuffled, two padding
    positions = torch.tensor([0, 3, 7, 63, 5, 0], device=DEVICE)
    n = len(slot_mapping)
    qkv = randn(g, n, (num_heads + 2 * num_kv_heads) * head_dim, dtype=dtype)
    cos, sin = rope_tables(head_dim)
    q_norm = (torch.rand(head_dim, generator=g) + 0.5).to(dtype).to(DEVICE) if qk_norm else None
    k_norm = (torch.rand(head_dim, generator=g) + 0.5).to(dtype).to(DEVICE) if qk_norm else None
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype, device=DEVICE)
    v_cache = torch.full(shape, float("nan"), dtype=dtype, device=DEVICE)
    if head_major:  # the GPU engine's cache: (block, kv_head, slot, dim) memory, transposed view
        k_cache, v_cache = (torch.full((num_blocks, num_kv_heads, block_size, head_dim), float("nan"),
                                       dtype=dtype, device=DEVICE).transpose(1, 2) for _ in range(2))

    q = ops.qkv_rope_store(qkv, positions, cos, sin, q_norm, k_norm, EPS, k_cache, v_cache,
                           slot_mapping, num_heads, num_kv_heads, head_dim)
    q_ref, k_ref, v_ref = qkv_rope_reference(qkv, positions, cos, sin, q_norm, k_norm,
                                             num_heads, num_kv_heads, head_dim)
    assert q.shape == (n, num_heads, head_dim) and q.dtype == dtype
    assert_close(q, q_ref, dtype)
    real = slot_mapping >= 0
    slots = slot_mapping[real]
    k_slots = k_cache.reshape(-1, num_kv_heads, head_dim)  # (num_blocks * block_size, kv_heads, dim)
    v_slots = v_cache.reshape(-1, num_kv_heads, head_dim)
    assert_close(k_slots[slots], k_ref[real], dtype)
    assert torch.equal(v_slots[slots], qkv[real, (num_heads + num_kv_heads) * head_dim:]
                       .view(-1, num_kv_heads, head_dim))
    untouched = torch.ones(num_blocks * block_size, dtype=torch.bool, device=DEVICE)
    untouched[slots] = False  # every other slot, padding tokens' included, still holds NaN
    assert k_slots[untouched].isnan().all() and v_slots[untouched].isnan().all()


# ------------------------------------------------------------------------------ whole models
def greedy(n):
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_tiny_model_fused_equals_unfused(tmp_path, family):
    make_tiny_hf_model(family, tmp_path, dtype=torch.float32)
    prompts = [[1, 5, 9, 14, 20], [1] + list(range(30, 41)), [1, 70, 3, 8, 66, 12, 50, 91, 4]]
    tokens = {}
    for fused in (False, True):
        llm = LLM(str(tmp_path), dtype="float32", attention_backend="triton", fused_ops=fused,
                  num_blocks=32, block_size=8)
        assert llm.engine.model.layer_set.name == ("fused" if fused else "torch")
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(6), use_tqdm=False)
        tokens[fused] = [o.outputs[0].token_ids for o in outs]
    assert all(len(t) == 6 for t in tokens[True])
    assert tokens[True] == tokens[False]


def test_stories260k_fused_matches_source_md():
    """The first 24 of SOURCE.md's 40 greedy tokens (all 40 take ~12 s under the interpreter;
    test_parity checks all of them on the unfused path)."""
    llm = LLM("stories260K", attention_backend="triton", fused_ops=True, num_blocks=64, block_size=8)
    assert llm.engine.model.layer_set.name == "fused"
    out = llm.generate("Once upon a time", greedy(24), use_tqdm=False)[0]
    ids = out.prompt_token_ids + out.outputs[0].token_ids
    assert ids == STORIES_EXPECTED[:len(out.prompt_token_ids) + 24]


def test_fused_ops_default_and_any_backend():
    """The config decides: on for CUDA with the Triton backend, off elsewhere. The backend
    interface is complete (store_kv / attend), so the fused layers also run with torch_ref,
    which then only attends to the K/V the fused kernel stored."""
    from minipaged.config import EngineConfig
    from minipaged.models.config import ModelConfig
    source = resolve_model("stories260K")
    mc = ModelConfig.from_dict(source.config)
    cfg = EngineConfig(device=DEVICE, attention_backend="triton").resolve(mc)
    assert cfg.fused_ops is (DEVICE == "cuda")
    assert EngineConfig(device=DEVICE, attention_backend="torch_ref").resolve(mc).fused_ops is False
    model, _ = load_model(source, torch.float32, torch.device(DEVICE), TorchRefBackend(), 64,
                          fused_ops=True)
    assert model.model.norm.__class__.__name__ == "FusedRMSNorm"
    llm = LLM("stories260K", attention_backend="torch_ref", fused_ops=True, num_blocks=64,
              block_size=8, device=DEVICE)
    out = llm.generate("Once upon a time", greedy(12), use_tqdm=False)[0]
    ids = out.prompt_token_ids + out.outputs[0].token_ids
    assert ids == STORIES_EXPECTED[:len(out.prompt_token_ids) + 12]