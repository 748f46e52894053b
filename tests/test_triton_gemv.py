"""The skinny GEMM (minipaged/models/triton_gemv.py) against F.linear in float64, its launch
configuration over the presets' shapes, and `FusedLinear` (fused_layers.py), which calls it for
steps of at most SKINNY_MAX_ROWS tokens, inside whole models, LoRA and fp8.

Without a GPU the kernel runs under the Triton interpreter (tests/conftest.py sets
TRITON_INTERPRET=1), so shapes are small; on CUDA the same tests run the compiled kernel.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.helpers import IGNORE_INTERPRETER_WARNINGS, make_tiny_hf_model, triton_device

DEVICE = triton_device()  # skips this module where Triton kernels cannot run

import triton  # noqa: E402

from minipaged import LLM, SamplingParams  # noqa: E402
from minipaged.models import triton_gemv  # noqa: E402
from minipaged.models.config import ModelConfig  # noqa: E402
from minipaged.models.fused_layers import FusedLinear  # noqa: E402
from minipaged.models.loader import dummy_presets, resolve_model  # noqa: E402
from minipaged.models.triton_gemv import (MAX_BLOCK_N, MIN_BLOCK_K, PROGRAMS_PER_SM,  # noqa: E402
                                          SKINNY_MAX_ROWS, TILE_ELEMENTS, SkinnyConfig,
                                          decoder_linear_shapes, skinny_config, skinny_linear)

pytestmark = IGNORE_INTERPRETER_WARNINGS

# |out - ref| <= atol + rtol |ref| against F.linear in float64 on the same (rounded) inputs. The
# kernel sums in fp32 and rounds once: the rounding is one unit in the last place of the output
# dtype at most (2^-7 relative for bf16, 2^-10 for fp16: the interpreter rounds fp32 -> bf16 by
# truncation, the GPU to nearest, half that), and the fp32 sums of a few hundred O(1/sqrt(K))
# products differ from float64 by far less than atol.
TOL = {torch.float32: (1e-5, 1e-5), torch.float16: (2 ** -10, 1e-4), torch.bfloat16: (2 ** -7, 1e-4)}


def operands(m, n, k, dtype, bias, seed=0):
    """x (m, k) ~ N(0, 1), weight (n, k) ~ N(0, 1/k) (outputs of order 1), bias (n,) or None."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(dtype).to(DEVICE)
    w = (torch.randn(n, k, generator=g) / k ** 0.5).to(dtype).to(DEVICE)
    b = torch.randn(n, generator=g).to(dtype).to(DEVICE) if bias else None
    return x, w, b


def assert_matches_float64(out, x, w, b):
    ref = F.linear(x.double(), w.double(), None if b is None else b.double())
    rtol, atol = TOL[x.dtype]
    assert out.dtype == x.dtype and out.shape == ref.shape
    torch.testing.assert_close(out.double(), ref, rtol=rtol, atol=atol)


# ------------------------------------------------------------------------------------- kernel
@pytest.mark.parametrize("m", range(1, SKINNY_MAX_ROWS + 1))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
def test_skinny_linear_equals_float64(m, dtype, bias):
    # N = 77, K = 300: neither a multiple of any block, so the last program's rows and the last
    # K chunk are masked (the default config here: BLOCK_N 8, BLOCK_K 512 on the interpreter's 1 SM)
    x, w, b = operands(m, 77, 300, dtype, bias, seed=m)
    assert_matches_float64(skinny_linear(x, w, b), x, w, b)


def test_a_rows_result_does_not_depend_on_the_other_rows():
    """Each row has its own accumulator, filled and summed in the same order whatever M is, so
    a sequence gets the same bits alone, beside another, or in a CUDA graph padded to 2 rows."""
    x, w, b = operands(SKINNY_MAX_ROWS, 77, 300, torch.bfloat16, True, seed=7)
    full = skinny_linear(x, w, b)
    for m in range(1, SKINNY_MAX_ROWS):
        assert torch.equal(skinny_linear(x[:m], w, b), full[:m])
        assert torch.equal(skinny_linear(x[m:], w, b), full[m:])


@pytest.mark.parametrize("config", [SkinnyConfig(1, 128, 1), SkinnyConfig(4, 256, 2),
                                    SkinnyConfig(2, 512, 4), SkinnyConfig(32, 128, 4)],
                         ids=str)
def test_skinny_linear_any_config(config):
    """Every launch computes the same product: one row or many per program, one K chunk or
    several, more rows than N."""
    for m, (n, k) in ((2, (45, 520)), (1, (6, 129))):
        x, w, b = operands(m, n, k, torch.bfloat16, True, seed=n)
        assert_matches_float64(skinny_linear(x, w, b, config), x, w, b)


def test_skinny_linear_reads_strided_and_transposed_inputs():
    x, w, b = operands(2, 40, 200, torch.float32, True)
    wide = torch.zeros(2, 232, device=DEVICE)
    wide[:, 16:216] = x
    strided = wide[:, 16:216]  # rows 232 apart
    assert_matches_float64(skinny_linear(strided, w, b), x, w, b)
    transposed = x.t().contiguous().t()  # last dim strided: copied once, then multiplied
    assert_matches_float64(skinny_linear(transposed, w, b), x, w, b)
    stacked = torch.cat([w, torch.ones(5, 200, device=DEVICE)])[:40]  # a view of a taller weight
    assert_matches_float64(skinny_linear(x, stacked, b), x, w, b)


def test_skinny_linear_guards_name_the_problem():
    x, w, b = operands(2, 8, 16, torch.float32, True)
    with pytest.raises(ValueError, match="0 rows"):
        skinny_linear(x[:0], w)
    with pytest.raises(ValueError, match=f"{SKINNY_MAX_ROWS + 1} rows"):
        skinny_linear(torch.zeros(SKINNY_MAX_ROWS + 1, 16, device=DEVICE), w)
    with pytest.raises(ValueError, match="same K"):
        skinny_linear(x, w[:, :15])
    with pytest.raises(ValueError, match="contiguous rows"):
        skinny_linear(x, torch.zeros(16, 8, device=DEVICE).t())
    with pytest.raises(ValueError, match=r"bias has shape \(7,\)"):
        skinny_linear(x, w, b[:7])


# ----------------------------------------------------------------------------- launch config
def preset_shapes():
    for preset in dummy_presets():
        cfg = ModelConfig.from_dict(resolve_model(f"dummy:{preset}").config)
        for name, shape in decoder_linear_shapes(cfg).items():
            yield pytest.param(shape, id=f"{preset}-{name}")


@pytest.mark.parametrize("shape", list(preset_shapes()))
@pytest.mark.parametrize("num_sms", [132, 78, 1])  # H200 / H100 SXM, A100 is 108; the interpreter
def test_skinny_config_fills_the_gpu_with_valid_blocks(shape, num_sms):
    """Every program count >= min(PROGRAMS_PER_SM x SMs, N) (= 264 on an H200 wherever N
    allows), blocks powers of two within their bounds, one tile of at most TILE_ELEMENTS."""
    n, k = shape
    c = skinny_config(n, k, num_sms)
    for size in (c.block_n, c.block_k, c.num_warps):
        assert size & (size - 1) == 0, c
    assert 1 <= c.block_n <= MAX_BLOCK_N and c.num_warps in (1, 2, 4, 8)
    assert MIN_BLOCK_K <= c.block_k <= max(MIN_BLOCK_K, triton.next_power_of_2(k))
    assert c.block_n * c.block_k <= TILE_ELEMENTS
    programs = -(-n // c.block_n)
    assert programs >= min(PROGRAMS_PER_SM * num_sms, n), (c, programs)
    # and no smaller BLOCK_N was needed: doubling it would have dropped below the target
    assert c.block_n == MAX_BLOCK_N or -(-n // (2 * c.block_n)) < PROGRAMS_PER_SM * num_sms


def test_skinny_config_of_qwen3_0_6b_on_an_h200():
    """The shapes of the one-stream profile, with the launches that read them fastest in
    skinny_gemm_h200.json: every layer at least 512 programs on 132 SMs."""
    cfg = ModelConfig.from_dict(resolve_model("dummy:qwen3-0.6b").config)
    shapes = decoder_linear_shapes(cfg)
    assert shapes == {"qkv_proj": (4096, 1024), "o_proj": (1024, 2048),
                      "gate_up_proj": (6144, 1024), "down_proj": (1024, 3072)}
    assert skinny_config(1024, 2048, 132) == SkinnyConfig(block_n=2, block_k=2048, num_warps=8)
    assert skinny_config(6144, 1024, 132) == SkinnyConfig(block_n=8, block_k=512, num_warps=8)
    assert min(-(-n // skinny_config(n, k, 132).block_n) for n, k in shapes.values()) == 512


# ------------------------------------------------------------------------------ FusedLinear
@pytest.fixture
def skinny_calls(monkeypatch):
    """Counts the calls FusedLinear makes to the kernel."""
    calls = []
    kernel = triton_gemv.skinny_linear

    def counted(*args, **kwargs):
        calls.append(args[0].shape[0])
        return kernel(*args, **kwargs)

    monkeypatch.setattr(triton_gemv, "skinny_linear", counted)
    return calls


def fused_linear(k, n, bias, dtype=torch.float32):
    layer = FusedLinear(k, n, bias=bias).to(DEVICE, dtype)
    with torch.no_grad():
        layer.weight.copy_(operands(1, n, k, dtype, False)[1])
    return layer


def test_fused_linear_uses_the_kernel_up_to_skinny_max_rows(skinny_calls):
    layer = fused_linear(96, 40, bias=True)
    x = operands(SKINNY_MAX_ROWS + 1, 40, 96, torch.float32, False)[0]
    for m in (1, SKINNY_MAX_ROWS):
        assert_matches_float64(layer(x[:m]), x[:m], layer.weight, layer.bias)
    assert skinny_calls == [1, SKINNY_MAX_ROWS]
    # above SKINNY_MAX_ROWS, for no rows, for other layouts and for float64: F.linear itself
    assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))
    assert layer(x[:0]).shape == (0, 40)
    assert layer(x[None, :2]).shape == (1, 2, 40)  # (batch, tokens, in): not a (M, K) matrix
    layer64 = fused_linear(96, 40, bias=False, dtype=torch.float64)
    assert torch.equal(layer64(x[:1].double()), F.linear(x[:1].double(), layer64.weight))
    assert skinny_calls == [1, SKINNY_MAX_ROWS]


def test_fused_model_builds_fused_projections_and_a_plain_lm_head(tmp_path):
    from minipaged.attention.torch_ref import TorchRefBackend
    from minipaged.models.loader import load_model
    make_tiny_hf_model("qwen2", tmp_path, dtype=torch.float32)
    model, _ = load_model(resolve_model(str(tmp_path)), torch.float32, torch.device(DEVICE),
                          TorchRefBackend(), 64, fused_ops=True)
    layer = model.model.layers[0]
    for proj in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
                 layer.mlp.down_proj):
        assert type(proj) is FusedLinear
    assert layer.self_attn.qkv_proj.bias is not None  # Qwen2's q/k/v bias
    assert type(model.lm_head) is nn.Linear


def greedy(n):
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def test_qwen2_fused_decode_runs_the_kernel_and_equals_unfused(tmp_path, skinny_calls):
    """Two sequences decode as 2-row steps (the kernel, with Qwen2's q/k/v bias); the prompt
    steps are larger (F.linear). The greedy tokens equal the torch layers'."""
    make_tiny_hf_model("qwen2", tmp_path, dtype=torch.float32)
    prompts = [[1, 5, 9, 14, 20], [1, 70, 3, 8, 66, 12, 50, 91, 4]]
    tokens = {}
    for fused in (False, True):
        llm = LLM(str(tmp_path), dtype="float32", attention_backend="triton", fused_ops=fused,
                  num_blocks=32, block_size=8, device=DEVICE)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(5), use_tqdm=False)
        tokens[fused] = [o.outputs[0].token_ids for o in outs]
    assert tokens[True] == tokens[False] and all(len(t) == 5 for t in tokens[True])
    assert 2 in skinny_calls and all(m <= SKINNY_MAX_ROWS for m in skinny_calls)


def test_fp8_replaces_fused_linear_layers():
    """quantization="fp8" turns the fused projections into fp8 layers like plain ones."""
    from minipaged.models.quantization.fp8 import Fp8Linear
    kw = dict(quantization="fp8", dtype="float32", attention_backend="triton", num_blocks=64,
              block_size=8, device=DEVICE)
    outs = {}
    for fused in (False, True):
        llm = LLM("stories260K", fused_ops=fused, **kw)
        attn = llm.engine.model.model.layers[0].self_attn
        assert isinstance(attn.qkv_proj, Fp8Linear) and isinstance(attn.o_proj, Fp8Linear)
        outs[fused] = llm.generate("Once upon a time", greedy(8), use_tqdm=False)[0].outputs[0].token_ids
    assert outs[True] == outs[False]


def test_programmatic_dependent_launch_only_where_the_gpu_has_it(monkeypatch):
    """PDL (kernel_launch.py) is an NVIDIA feature of compute capability 9.0 on: never on the
    CPU or an AMD GPU, and MINIPAGED_PDL=0 turns it off (tests/test_gpu.py compares the two on
    a GPU)."""
    from minipaged.kernel_launch import launch_pdl
    assert launch_pdl(torch.device("cpu")) is False
    with monkeypatch.context() as m:  # ROCm builds of torch call AMD GPUs "cuda" too
        m.setattr(torch.version, "hip", "6.4")
        assert launch_pdl(torch.device("cuda")) is False
    monkeypatch.setenv("MINIPAGED_PDL", "0")
    assert launch_pdl(torch.device("cpu")) is False
    if torch.cuda.is_available():
        assert launch_pdl(torch.device("cuda")) is False
        monkeypatch.setenv("MINIPAGED_PDL", "1")
        assert launch_pdl(torch.device("cuda")) == (torch.cuda.get_device_capability() >= (9, 0))
