"""The per-token fp8 quantization of fp8.py's activations as one Triton kernel (CUDA, lesson 11).

`quantize_rowwise` in torch is about eight kernels per linear layer (abs, amax, the scale's
three small ops, divide, clamp, cast), with two full-size fp32 temporaries; a decoder layer has
four linear layers. This kernel does it in one pass per token row: load the row, take max|x|,
scale = max(max|x|, 1e-12) / 448, store round_e4m3(clamp(x / scale)) and the scale. The division
is correctly rounded (`div_rn`) as torch's is and the rounding to e4m3 is done by hand (to
nearest even, as torch's cast), so the bits equal `quantize_rowwise`'s
(`tests/test_fp8.py` checks it under TRITON_INTERPRET=1, `tests/test_gpu.py` on the GPU).

`ScaledMMFp8Linear` (fp8.py) quantizes with it before `torch._scaled_mm`.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from minipaged.models.quantization.fp8_format import AMAX_FLOOR, FP8_DTYPE, FP8_MAX


@triton.jit
def per_token_quant_fp8_kernel(
    x_ptr,  # (num_tokens, hidden), last dim contiguous
    q_ptr,  # (num_tokens, hidden) float8_e4m3fn, contiguous
    scale_ptr,  # (num_tokens,) fp32
    stride_x, hidden, amax_floor, fp8_max,
    BLOCK: tl.constexpr,  # next power of two >= hidden
):
    row = tl.program_id(0).to(tl.int64)  # one program per token
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    amax = tl.max(tl.abs(x), axis=0)
    scale = tl.maximum(amax, amax_floor) / fp8_max
    q = tl.math.div_rn(x, tl.full([BLOCK], 1.0, tl.float32) * scale)
    q = tl.minimum(tl.maximum(q, -fp8_max), fp8_max)
    # Round to e4m3 here, to nearest even, so that the cast below is exact (the same bits on
    # the GPU and under the interpreter, whose own fp8 rounding differs): normals keep 3 of
    # fp32's 23 mantissa bits; below 2^-6 (e4m3's subnormals) the step is a fixed 2^-9.
    bits = q.to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFFF + ((bits >> 20) & 1)) & -1048576  # -1048576: 0xFFF00000
    normal = bits.to(tl.float32, bitcast=True)
    subnormal = ((tl.abs(q) * 512.0 + 12582912.0) - 12582912.0) / 512.0  # 1.5 * 2^23: rint
    subnormal = tl.where(q < 0, -subnormal, subnormal)  # the sign, -0.0 included
    q = tl.where(tl.abs(q) < 0.015625, subnormal, normal)
    tl.store(q_ptr + row * hidden + cols, q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(scale_ptr + row, scale)


def per_token_quant_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x (num_tokens, hidden) -> (x_q float8_e4m3fn (num_tokens, hidden), scale fp32
    (num_tokens, 1)): `fp8.quantize_rowwise` in one kernel."""
    n, hidden = x.shape
    if x.stride(-1) != 1:
        x = x.contiguous()
    x_q = torch.empty((n, hidden), dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty((n, 1), dtype=torch.float32, device=x.device)
    block = triton.next_power_of_2(hidden)
    if n:
        per_token_quant_fp8_kernel[(n,)](x, x_q, scale, x.stride(0), hidden, AMAX_FLOOR,
                                         FP8_MAX, BLOCK=block,
                                         num_warps=1 if block <= 256 else 4 if block <= 2048
                                         else 8)
    return x_q, scale
