"""Programmatic dependent launch: the next kernel of a step starts while this one finishes.

A decode step of one sequence is ~300 small kernels, each a few microseconds long, and between two
of them the GPU idles: the first kernel's last programs drain, then the second is launched, its
programs are placed on the SMs and only then issue their first loads. On Hopper GPUs (compute
capability 9.0 and later) a kernel launched with programmatic dependent launch (PDL) may start
before the kernel ahead of it in the stream has finished; it must then wait, with
`griddepcontrol.wait`, before it touches anything that kernel wrote. On an H200 it took a
one-stream decode step of Qwen3-0.6B from 1.10 to 0.94 ms of GPU time
(benchmarks/experiments/decode_step/one_stream_pdl_h200.json); lesson 08
(notebooks/08_benchmark.ipynb) explains why a decode step is so many small kernels.

Every Triton kernel on the decode path of the fused layers (`models/triton_ops.py`,
`models/triton_gemv.py`) and the paged-attention kernel (`attention/triton_kernels.py`) takes a
`USE_PDL` constexpr and is launched with `launch_pdl=USE_PDL`. With it, a kernel's first act is
`wait_for_previous_kernel`:

    griddepcontrol.wait               block until the kernel before has completed and its
                                      writes are visible (a no-op if it already has)
    griddepcontrol.launch_dependents  the kernel after may now be launched; its programs take
                                      SM slots as ours finish and wait in their turn

The one exception reads before it waits: `skinny_linear_kernel` loads its first tile of weights,
which no kernel of a step writes, so the weight stream of a linear layer starts while the kernel
before it (the norm that produces its input) is still running. Kernels launched without PDL
(cuBLAS, torch's own) wait as always, and a PDL kernel after one of them simply starts when it
ends, so the two kinds mix freely. CUDA graphs record the dependency as a programmatic edge.

    launch_pdl(device) -> bool   PDL for kernels launched on `device`: an NVIDIA GPU of compute
                                 capability >= 9, unless MINIPAGED_PDL=0 (off switch for A/Bs)
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

_CAPABLE: dict[str, bool] = {}


def launch_pdl(device: torch.device) -> bool:
    """Launch this device's step kernels with programmatic dependent launch (module docstring)."""
    if (device.type != "cuda" or torch.version.hip is not None  # ROCm also says "cuda"
            or os.environ.get("MINIPAGED_PDL", "1") == "0"):
        return False
    key = str(device)
    if key not in _CAPABLE:
        _CAPABLE[key] = torch.cuda.get_device_capability(device) >= (9, 0)
    return _CAPABLE[key]


@triton.jit
def wait_for_previous_kernel(USE_PDL: tl.constexpr):
    """With PDL: wait until the kernel before has finished, then let the next one launch."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
