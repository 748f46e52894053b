"""fp8 weights: float8 e4m3 linear layers with per-channel weight and per-token activation
scales (`quantization="fp8"`, lesson 11).

Every linear layer of a decoder layer (`qkv_proj`, `o_proj`, `gate_up_proj`, `down_proj`)
becomes an `Fp8Linear` once its float weights are loaded:

    weight  W (out, in)  ->  W_q (out, in) float8_e4m3fn,  w_scale (out,) fp32
            each output row r scaled so its largest |value| lands on 448, e4m3's largest:
            w_scale[r] = max|W[r]| / 448,  W_q[r] = round_e4m3(W[r] / w_scale[r])
    input   x (tokens, in), per step   ->  x_q float8_e4m3fn,  x_scale (tokens, 1) fp32,
            the same rule per token row ("dynamic": scales measured on every call)
    output  y = (x_q * x_scale) @ (W_q * w_scale)^T  (+ bias),  in the activations' dtype

The scales are per row of each operand, so they factor out of the dot products: y[t, r] =
x_scale[t] * w_scale[r] * sum_k x_q[t, k] W_q[r, k]. That is what Hopper's fp8 tensor cores
compute (`torch._scaled_mm` with row-wise scales: the fp8 products summed in fp32, both scales
applied on the way out). Two implementations of one layer, chosen once when it is built:

    Fp8Linear          the definition: both operands dequantized to fp32 and multiplied; the
                       CPU path (CI tests it), and the CUDA fallback for shapes _scaled_mm refuses
    ScaledMMFp8Linear  `torch._scaled_mm` on CUDA (compute capability 8.9+, bf16 activations,
                       in and out features multiples of 16), the input quantized by one Triton
                       kernel (fp8_triton.py); same numbers to fp32 rounding

What it keeps and loses: e4m3 has 3 mantissa bits, so rounding to it moves a value by at most
2^-4 of itself (half a unit in the last place) while |value / scale| >= 2^-6, e4m3's smallest
normal; below that, by at most 2^-10 scale (half the subnormal spacing 2^-9). Per element:

    |W - W_q * w_scale| <= max(2^-4 |W|, 2^-10 max|W[r]| / 448)

`tests/test_fp8.py` checks that bound; lessons/quantization.py measures what it does to the
logits. The embeddings, norms and LM head stay in the model's dtype (as vLLM's fp8 does): the
models here tie the LM head to the embedding table, which a lookup needs in float anyway, and
the logits the sampler reads are the place where 3 mantissa bits cost the most.

With tensor parallelism each rank quantizes its own shard: column-parallel layers are plain
`Fp8Linear`s of their rows, and `o_proj` / `down_proj` become `Fp8RowParallelLinear`, which
all-reduces its partial sums. Scales are then per row of each rank's slice, so the numbers differ
slightly from one device's. With `enable_lora` the engine wraps the fp8 layers afterwards
(lora/manager.py): each adapter's shrink / expand reads the float activations beside them.
"""
from __future__ import annotations

import logging
from typing import Optional

import torch
from torch import nn

from minipaged.models.quantization.fp8_format import AMAX_FLOOR, FP8_DTYPE, FP8_MAX

logger = logging.getLogger("minipaged.quantization")


def quantize_rowwise(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x (rows, cols) -> (x_q float8_e4m3fn (rows, cols), scale fp32 (rows, 1)): each row divided
    by max|row| / 448 and rounded to e4m3 (nearest, ties to even), so x ~ x_q * scale."""
    amax = x.abs().amax(dim=-1, keepdim=True).float()  # (rows, 1)
    scale = amax.clamp(min=AMAX_FLOOR) / FP8_MAX
    x_q = (x / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)  # clamp: rounding can pass 448
    return x_q, scale


def dequantize(x_q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x_q * scale in fp32 (scale broadcasts: (rows, 1) per row, (1, cols) per column)."""
    return x_q.float() * scale


def fp8_matmul_dequant(x_q, x_scale, w_q, w_scale, out_dtype: torch.dtype) -> torch.Tensor:
    """The definition: (x_q x_scale) @ (W_q w_scale)^T, both dequantized to fp32 first.
    x_q (tokens, in), x_scale (tokens, 1), w_q (out, in), w_scale (out,) -> (tokens, out)."""
    x = dequantize(x_q, x_scale)  # (tokens, in)
    w = dequantize(w_q, w_scale[:, None])  # (out, in)
    return (x @ w.t()).to(out_dtype)


def fp8_matmul_scaled_mm(x_q, x_scale, w_q, w_scale, out_dtype: torch.dtype) -> torch.Tensor:
    """The same product on Hopper's fp8 tensor cores. `_scaled_mm(a, b)`: a row-major
    (tokens, in), b column-major (in, out), which `w_q.t()` of a row-major (out, in) weight is;
    row-wise scales as (tokens, 1) and (1, out) fp32; bf16 out."""
    return torch._scaled_mm(x_q, w_q.t(), scale_a=x_scale, scale_b=w_scale[None, :],
                            out_dtype=out_dtype)


class Fp8Linear(nn.Module):
    """y = x W^T + b with W stored as float8 e4m3 and one fp32 scale per output row; x is
    quantized per token on every call. This class multiplies dequantized fp32 operands."""

    def __init__(self, weight_q: torch.Tensor, weight_scale: torch.Tensor,
                 bias: Optional[torch.Tensor]):
        super().__init__()
        self.out_features, self.in_features = weight_q.shape
        # parameters, not buffers, so that counting the model's bytes sees one byte per weight
        self.weight = nn.Parameter(weight_q, requires_grad=False)  # (out, in) float8_e4m3fn
        self.weight_scale = nn.Parameter(weight_scale, requires_grad=False)  # (out,) fp32
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    @classmethod
    @torch.no_grad()
    def from_linear(cls, linear: nn.Linear, **extra) -> "Fp8Linear":
        """Quantize a loaded float layer's weight per output row (its bias stays float)."""
        w_q, scale = quantize_rowwise(linear.weight)
        bias = None if linear.bias is None else linear.bias.detach()
        return cls(w_q, scale.view(-1), bias, **extra)

    def fp8_matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x (tokens, in) in the model's dtype -> x W^T (tokens, out), no bias."""
        x_q, x_scale = quantize_rowwise(x)  # (tokens, in) fp8, (tokens, 1) fp32
        return fp8_matmul_dequant(x_q, x_scale, self.weight, self.weight_scale, x.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.fp8_matmul(x)  # (tokens, out)
        return out if self.bias is None else out + self.bias

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, weight=float8_e4m3fn per-channel")


class ScaledMMFp8Linear(Fp8Linear):
    """The same layer multiplied by `torch._scaled_mm` (CUDA, fp8 tensor cores), its input
    quantized by one Triton kernel (fp8_triton.py: `quantize_rowwise`'s numbers in one pass)."""

    def __init__(self, weight_q, weight_scale, bias):
        super().__init__(weight_q, weight_scale, bias)
        from minipaged.models.quantization.fp8_triton import per_token_quant_fp8
        self.quantize_input = per_token_quant_fp8

    def fp8_matmul(self, x: torch.Tensor) -> torch.Tensor:
        x_q, x_scale = self.quantize_input(x)  # (tokens, in) fp8, (tokens, 1) fp32
        return fp8_matmul_scaled_mm(x_q, x_scale, self.weight, self.weight_scale, x.dtype)


class Fp8RowParallelLinear(nn.Module):
    """Tensor parallelism's row-parallel layer in fp8: this rank's fp8 partial product, then the
    all-reduce that adds the N ranks' parts (models/parallel_layers.py), then the bias once."""

    def __init__(self, inner: Fp8Linear, tp):
        super().__init__()
        self.inner, self.tp = inner, tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from minipaged.distributed.parallel_state import all_reduce
        out = all_reduce(self.inner.fp8_matmul(x), self.tp)  # (tokens, out)
        return out if self.inner.bias is None else out + self.inner.bias


def scaled_mm_supported(linear: nn.Linear) -> bool:
    """Can `_scaled_mm` multiply this layer? CUDA with fp8 tensor cores (compute capability 8.9+,
    Ada / Hopper), bf16 activations (its row-wise scaling writes bf16 only), and in / out
    features that are multiples of 16 (its tile constraint on both of the weight's dims)."""
    w = linear.weight
    if not w.is_cuda or w.dtype != torch.bfloat16:
        return False
    if torch.cuda.get_device_capability(w.device) < (8, 9):
        return False
    return linear.in_features % 16 == 0 and linear.out_features % 16 == 0


def fp8_linear(linear: nn.Linear) -> nn.Module:
    """The fp8 variant of one loaded layer, its implementation chosen here, once."""
    from minipaged.models.parallel_layers import RowParallelLinear
    cls = ScaledMMFp8Linear if scaled_mm_supported(linear) else Fp8Linear
    layer = cls.from_linear(linear)
    if cls is ScaledMMFp8Linear and not _scaled_mm_runs(layer):
        layer = Fp8Linear.from_linear(linear)
    if isinstance(linear, RowParallelLinear):
        return Fp8RowParallelLinear(layer, linear.tp)
    return layer


def _scaled_mm_runs(layer: ScaledMMFp8Linear) -> bool:
    """One call on a zero token: a torch build without row-wise fp8 GEMMs says so here, at
    build, and the layer falls back to the dequantizing path (with a warning) instead of
    failing mid-serving."""
    try:
        x = torch.zeros(1, layer.in_features, dtype=torch.bfloat16, device=layer.weight.device)
        layer.fp8_matmul(x)
        return True
    except Exception as e:  # noqa: BLE001 (a refusal, or the quantize kernel failing to build)
        logger.warning("torch._scaled_mm refused a (%d -> %d) fp8 layer (%s); it runs "
                       "dequantized instead", layer.in_features, layer.out_features, e)
        return False


LINEAR_NAMES = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")


@torch.no_grad()
def quantize_model_fp8(model: nn.Module) -> nn.Module:
    """Replace every decoder layer's four linear layers by their fp8 variant, in place, layer
    by layer (each float weight is freed as soon as its fp8 copy exists)."""
    for layer in model.model.layers:
        for path in LINEAR_NAMES:
            parent_name, name = path.split(".")
            parent = getattr(layer, parent_name)
            setattr(parent, name, fp8_linear(getattr(parent, name)))
    model.quantization = "fp8"
    return model
