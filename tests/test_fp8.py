"""fp8 weights (`quantization="fp8"`, models/quantization/fp8.py), on the CPU's dequantizing path.

- the per-channel e4m3 round trip: every element rounds to the nearest e4m3 value of the e4m3
  grid (enumerated here from the 256 bit patterns, not through torch's cast), so its error is at
  most max(2^-4 |w|, 2^-10 scale), the bound fp8.py derives; each row's largest |w| is exact;
- `Fp8Linear` against a float64 reference written from the formulas: per-token and per-channel
  scales, grid rounding, dequantize, multiply;
- stories260K with quantization="fp8": only the decoder's linear layers change, greedy text
  agrees with float32 for its first tokens, logits over a fixed text keep a cosine > 0.998 and a
  top-1 agreement >= 88% (measured: 0.9995 and 93.1%); with kv_cache_dtype="fp8" as well; and
  split over 2 ranks (tensor parallelism);
- the config guard names the field, the value and what is allowed.
"""
import argparse

import pytest
import torch
import torch.nn.functional as F

from minipaged import LLM, EngineConfig, SamplingParams
from minipaged.cli.args import add_engine_args, engine_config_from_args
from minipaged.lessons.quantization import fp8_accuracy, greedy_side_by_side
from minipaged.models.quantization.fp8 import (FP8_MAX, Fp8Linear, Fp8RowParallelLinear,
                                               dequantize, quantize_rowwise)


def e4m3_grid() -> torch.Tensor:
    """Every finite float8 e4m3fn value, sorted, decoded from its bits (1 sign, 4 exponent with
    bias 7, 3 mantissa; exponent 0 is subnormal; S.1111.111 is NaN, there is no infinity)."""
    values = set()
    for bits in range(256):
        sign, exp, man = bits >> 7, (bits >> 3) & 0xF, bits & 0x7
        if exp == 0xF and man == 0x7:
            continue
        v = (man / 8) * 2.0 ** -6 if exp == 0 else (1 + man / 8) * 2.0 ** (exp - 7)
        values.add(-v if sign else v)
    return torch.tensor(sorted(values), dtype=torch.float64)


GRID = e4m3_grid()


def round_to_grid(x: torch.Tensor) -> torch.Tensor:
    """x (float64, inside [-448, 448]) -> its nearest e4m3 value (ties: either neighbour)."""
    idx = torch.searchsorted(GRID, x.contiguous()).clamp(1, len(GRID) - 1)
    lo, hi = GRID[idx - 1], GRID[idx]
    return torch.where((x - lo).abs() <= (hi - x).abs(), lo, hi)


def reference_quantize(x: torch.Tensor):
    """float64 per-row quantization, written from the formula: scale = max|row| / 448."""
    x = x.double()
    scale = x.abs().amax(-1, keepdim=True).clamp(min=1e-12) / FP8_MAX
    return round_to_grid((x / scale).clamp(-FP8_MAX, FP8_MAX)), scale


def test_grid_is_e4m3():
    assert len(GRID) == 253  # 256 patterns, minus 2 NaNs, with +0 and -0 counted once
    assert GRID.max() == 448 and GRID[GRID > 0].min() == 2.0 ** -9
    assert torch.equal(GRID.to(torch.float8_e4m3fn).double(), GRID)


def weights_with_spread(rows=48, cols=96, seed=0) -> torch.Tensor:
    """Rows whose scales span 10^-4..10^2 and whose elements span 2^-14 of the row max (the
    subnormal range too), plus an all-zero row."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=g) * torch.logspace(-4, 2, rows)[:, None]
    w[:, :8] *= 2.0 ** -torch.arange(8, dtype=torch.float32) * 1e-2  # tiny entries per row
    w[-1] = 0
    return w


def test_per_channel_round_trip_is_within_the_e4m3_bound():
    w = weights_with_spread()
    w_q, scale = quantize_rowwise(w)
    assert w_q.dtype == torch.float8_e4m3fn and scale.shape == (w.shape[0], 1)
    back = dequantize(w_q, scale)
    err = (w.double() - back.double()).abs()
    row_max = w.abs().amax(-1, keepdim=True).double()
    bound = torch.maximum(2.0 ** -4 * w.abs().double(), 2.0 ** -10 * row_max / FP8_MAX)
    assert (err <= bound * (1 + 1e-5) + 1e-30).all(), float((err / bound).max())
    # the bound is reached, not loose: some element rounds by more than half of it
    assert float((err / bound.clamp(min=1e-30)).max()) > 0.5
    # each row's largest |w| lands on 448 exactly, so it comes back exactly
    assert torch.allclose(back.abs().amax(-1, keepdim=True).double(), row_max, rtol=1e-6)
    assert torch.equal(back[-1], torch.zeros_like(back[-1]))  # the zero row stays zero


def test_rounding_is_nearest_on_the_e4m3_grid():
    w = weights_with_spread(seed=1)
    w_q, scale = quantize_rowwise(w)
    ref_q, ref_scale = reference_quantize(w)
    assert torch.allclose(scale.double(), ref_scale, rtol=1e-6)
    got = w_q.double()
    x = (w.double() / ref_scale).clamp(-FP8_MAX, FP8_MAX)
    # the same grid point, or (at an exact tie, after fp32 rounding of the scale) the other
    # neighbour at the same distance
    same = got == ref_q
    tie = ((got - x).abs() - (ref_q - x).abs()).abs() <= 1e-6 * x.abs().clamp(min=2.0 ** -9)
    assert (same | tie).all()
    assert same.float().mean() > 0.999


@pytest.mark.parametrize("bias", [False, True])
def test_fp8_linear_equals_an_independent_float64_reference(bias):
    g = torch.Generator().manual_seed(2)
    linear = torch.nn.Linear(96, 80, bias=bias)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(80, 96, generator=g) * torch.logspace(-2, 0, 80)[:, None])
        if bias:
            linear.bias.copy_(torch.randn(80, generator=g))
    x = torch.randn(7, 96, generator=g) * torch.logspace(-3, 1, 7)[:, None]  # tokens of all sizes
    x[3] = 0  # a token of zeros
    layer = Fp8Linear.from_linear(linear)
    got = layer(x)
    assert got.shape == (7, 80) and got.dtype == torch.float32
    xq, xs = reference_quantize(x)
    wq, ws = reference_quantize(linear.weight.detach())
    want = (xq * xs) @ (wq * ws).t()
    if bias:
        want = want + linear.bias.detach().double()
    assert torch.allclose(got.double(), want, rtol=1e-5, atol=1e-6 * want.abs().max())
    # and it is a quantized layer: close to the float one, not equal to it
    exact = F.linear(x, linear.weight, linear.bias).double()
    rel = (got.double() - exact).norm() / exact.norm()
    assert 1e-4 < rel < 0.05, float(rel)


def test_fp8_linear_keeps_the_activations_dtype():
    linear = torch.nn.Linear(32, 16, bias=False).to(torch.bfloat16)
    x = torch.randn(5, 32, dtype=torch.bfloat16)
    layer = Fp8Linear.from_linear(linear)
    assert layer(x).dtype == torch.bfloat16
    assert layer.weight.dtype == torch.float8_e4m3fn and layer.weight_scale.dtype == torch.float32


GREEDY = SamplingParams(temperature=0.0, max_tokens=40)


@pytest.fixture(scope="module")
def float_llm():
    return LLM("stories260K", device="cpu", dtype="float32")


@pytest.fixture(scope="module")
def fp8_llm():
    return LLM("stories260K", device="cpu", dtype="float32", quantization="fp8")


def test_only_the_decoder_linear_layers_are_quantized(float_llm, fp8_llm):
    model = fp8_llm.engine.model
    fp8 = {n for n, p in model.named_parameters() if p.dtype == torch.float8_e4m3fn}
    want = {f"model.layers.{i}.{path}.weight" for i in range(5)
            for path in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj",
                         "mlp.down_proj")}
    assert fp8 == want
    assert model.model.embed_tokens.weight.dtype == torch.float32  # tied LM head too
    # isinstance: on the CPU each module's class is a direct-call subclass (direct_calls.py)
    assert all(isinstance(layer.self_attn.qkv_proj, Fp8Linear) for layer in model.model.layers)
    assert fp8_llm.engine.config.quantization == "fp8"
    assert float_llm.engine.config.quantization is None


def test_stories260k_fp8_agrees_with_float32(float_llm, fp8_llm):
    acc = fp8_accuracy(float_llm, fp8_llm)
    assert acc.num_positions > 100
    assert acc.mean_cosine > 0.998 and acc.min_cosine > 0.97, acc.summary()
    assert acc.top1_agreement >= 0.88, acc.summary()
    assert acc.max_abs_diff > 1e-3  # the weights did change
    # where the top-1 token changes, float32 was nearly undecided (measured: 0.05 vs 0.72)
    assert acc.gap_where(False) < 0.25 < acc.gap_where(True), acc.summary()
    side = greedy_side_by_side(float_llm, fp8_llm, max_tokens=40)
    first = side["first_difference"]
    assert first is None or first >= 8, side  # measured: the stories part at output token 16
    assert side["fp8"].startswith(", there was a little girl named Lily.")


def test_fp8_weights_compose_with_an_fp8_kv_cache(float_llm):
    llm = LLM("stories260K", device="cpu", dtype="float32", quantization="fp8",
              kv_cache_dtype="fp8")
    assert llm.engine.kv_cache.dtype == torch.float8_e4m3fn
    acc = fp8_accuracy(float_llm, llm)
    assert acc.mean_cosine > 0.997 and acc.top1_agreement >= 0.85, acc.summary()
    out = llm.generate(["Once upon a time"], GREEDY, use_tqdm=False)[0].outputs[0]
    assert out.text.startswith(", there was a little girl named Lily.")


def test_fp8_with_tensor_parallelism(float_llm, fp8_llm):
    """Each rank quantizes its shard (row-parallel layers per row of their slice), so the
    tokens need not equal one device's fp8 exactly: the stories still agree for their opening."""
    llm = LLM("stories260K", device="cpu", dtype="float32", quantization="fp8",
              tensor_parallel_size=2)
    layer = llm.engine.model.model.layers[0]
    assert isinstance(layer.self_attn.o_proj, Fp8RowParallelLinear)
    assert isinstance(layer.mlp.down_proj, Fp8RowParallelLinear)
    assert isinstance(layer.self_attn.qkv_proj, Fp8Linear)
    assert not isinstance(layer.self_attn.qkv_proj, Fp8RowParallelLinear)
    prompts = ["Once upon a time", "The cat", "Lily and Ben went to the"]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    tp = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    ref = [o.outputs[0].token_ids for o in float_llm.generate(prompts, params, use_tqdm=False)]
    for a, b in zip(tp, ref):
        assert a[:6] == b[:6]
    agree = sum(x == y for a, b in zip(tp, ref) for x, y in zip(a, b)) / sum(map(len, ref))
    assert agree >= 0.5, agree
    del llm  # the workers stop with the engine


@pytest.mark.parametrize("value", ["int4", "FP8", True, 8])
def test_quantization_guard_names_the_field_and_the_choices(value):
    with pytest.raises(ValueError) as e:
        EngineConfig(quantization=value).validate()
    msg = str(e.value)
    assert msg.startswith("quantization") and "fp8" in msg and repr(value) in msg


def test_quantization_flag():
    p = argparse.ArgumentParser()
    add_engine_args(p)
    assert engine_config_from_args(p.parse_args(["--quantization", "fp8"])).quantization == "fp8"
    assert engine_config_from_args(p.parse_args([])).quantization is None
    with pytest.raises(SystemExit):  # argparse's choices refuse the rest
        p.parse_args(["--quantization", "int4"])


def test_bench_counts_fp8_weights_at_their_bytes(float_llm, fp8_llm):
    """lessons/bench.py's bandwidth: weights read once per step, as stored (1 byte per fp8)."""
    from types import SimpleNamespace

    from minipaged.lessons import bench
    wl = bench.Workload("none", [[1]], [0])  # no decode: no KV read
    steps = [SimpleNamespace(num_batched_tokens=1)] * 1000
    read = {name: bench.bandwidth(llm, wl, 1.0, steps)["approx_bytes_read_gb"] * 1e9 / 1000
            for name, llm in (("float", float_llm), ("fp8", fp8_llm))}
    stored = {name: sum(p.numel() * p.element_size() for p in llm.engine.model.parameters())
              for name, llm in (("float", float_llm), ("fp8", fp8_llm))}
    assert read["fp8"] / read["float"] == pytest.approx(stored["fp8"] / stored["float"], rel=0.05)
    assert stored["fp8"] < 0.5 * stored["float"]


def test_hf_baselines_refuse_quantized_dummy_weights(fp8_llm):
    from minipaged.lessons import bench
    with pytest.raises(ValueError, match="quantization='fp8'.*without --quantization"):
        bench.hf_from_dummy(fp8_llm)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hidden", [64, 172, 1000])
def test_triton_per_token_quant_equals_quantize_rowwise(dtype, hidden):
    """fp8_triton.py's kernel (the CUDA layer's input quantization) under the interpreter: the
    same scales and the same fp8 values (its e4m3 rounding is done by hand, nearest even)."""
    from minipaged.models.quantization.fp8_triton import per_token_quant_fp8
    g = torch.Generator().manual_seed(hidden)
    x = torch.randn(7, hidden, generator=g) * torch.logspace(-3, 2, 7)[:, None]
    x[2] = 0
    x[3, :10] *= 1e-4  # values in e4m3's subnormal range after scaling
    x = x.to(dtype)
    want_q, want_s = quantize_rowwise(x)
    got_q, got_s = per_token_quant_fp8(x)
    assert got_q.dtype == torch.float8_e4m3fn and got_s.shape == (7, 1)
    assert torch.equal(got_s, want_s)
    assert torch.equal(got_q.float(), want_q.float())  # (the interpreter writes -0 as +0)


def test_fp8_weights_with_lora_adapters(tmp_path):
    """enable_lora wraps the fp8 layers (their float input feeds the adapters): an adapter's
    greedy story under fp8 weights opens as it does under float32 weights, and differs from
    the fp8 base model's."""
    from minipaged import LoRARequest
    from minipaged.lora.layers import LoRALinear
    from minipaged.lora.random_adapter import save_random_adapter
    from minipaged.models.config import ModelConfig
    from minipaged.models.loader import resolve_model
    cfg = ModelConfig.from_dict(resolve_model("stories260K").config)
    path = save_random_adapter(str(tmp_path / "a"), cfg, rank=8, seed=3, std=0.02)
    req = LoRARequest("a", 1, path)
    params = SamplingParams(temperature=0.0, max_tokens=30)
    outs = {}
    for q in (None, "fp8"):
        llm = LLM("stories260K", device="cpu", dtype="float32", enable_lora=True, max_loras=2,
                  max_lora_rank=16, quantization=q)
        qkv = llm.engine.model.model.layers[0].self_attn.qkv_proj
        assert isinstance(qkv, LoRALinear)
        assert isinstance(qkv.base_layer, Fp8Linear) == (q == "fp8")
        outs[q] = [o.outputs[0].token_ids for o in llm.generate(
            ["Once upon a time"] * 2, params, lora_request=[req, None], use_tqdm=False)]
    assert outs["fp8"][0][:12] == outs[None][0][:12]
    assert outs["fp8"][0] != outs["fp8"][1]  # the adapter changed the fp8 model's story
