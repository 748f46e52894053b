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

The other launch helper here, `CompiledLaunch`, cuts the host's side of a launch: a kernel that
the host launches on every step, outside any CUDA graph, goes through the variant Triton already
compiled for its arguments instead of Triton's per-call dispatch.
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


class CompiledLaunch:
    """Launch a Triton kernel on the GPU through the variant Triton compiled for the arguments,
    skipping the per-call dispatch of `kernel[grid](...)`.

    That dispatch binds and specialises every argument and looks the variant up: 23 us of host
    time a launch of masked_argmax_kernel on the H200's host, against 15 us through the compiled
    variant's launcher (benchmarks/experiments/structured_outputs/masked_argmax_launch.py), and
    a host-bound decode step pays it on its critical path (the sampler's kernels,
    sampling/kernels.py). Variants are kept, per device, by what Triton specialises on: each
    tensor's dtype and whether its address is a multiple of 16, and each integer's value
    (stricter than Triton's "1 / divisible by 16", so never a wrong variant), except an integer
    the kernel does not specialise on (`do_not_specialize`, a per-step seed): only whether it
    fits in 32 bits, which picks its type. The arguments are tensors and ints only, the other
    ints taking few values (strides, sizes); the kernel uses no globals that change and has no
    pre-run hooks, which Triton's path checks and this one does not. The first launch of a
    variant, the interpreter, and a launch hook (a profiler) take Triton's own path. (A cache of
    compiled code, as Triton's own is.)"""

    def __init__(self, kernel):
        self.kernel = kernel
        self.variants: dict = {}
        self.unspecialized = {p.num for p in getattr(kernel, "params", ())  # (interpreter: none)
                              if p.do_not_specialize}

    def __call__(self, grid: tuple, *args, num_warps: int, **constexprs) -> None:
        """kernel[grid](*args, num_warps=num_warps, **constexprs): every argument before the
        constexprs positional, the constexprs by name in the kernel's order."""
        if args[0].device.type != "cuda":  # the interpreter
            self.kernel[grid](*args, num_warps=num_warps, **constexprs)
            return
        device = triton.runtime.driver.active.get_current_device()  # as Triton launches
        key = (device, num_warps, *constexprs.values(), *(
            (a.dtype, a.data_ptr() % 16 == 0) if isinstance(a, torch.Tensor)
            else (-2**31 <= a < 2**31) if i in self.unspecialized else a
            for i, a in enumerate(args)))
        compiled = self.variants.get(key)
        if compiled is None or _launch_hooked():
            assert list(constexprs) == self.kernel.arg_names[len(args):], list(constexprs)
            assert all(isinstance(a, torch.Tensor) or type(a) is int for a in args), args
            self.variants[key] = self.kernel[grid](*args, num_warps=num_warps, **constexprs)
            return
        stream = triton.runtime.driver.active.get_current_stream(device)
        compiled.run(grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1,
                     stream, compiled.function, compiled.packed_metadata, None, None, None,
                     *args, *constexprs.values())


def _launch_hooked() -> bool:
    """Has a launch hook (a profiler's) been set? (Triton 3.6 keeps them as chains of calls.)"""
    runtime = triton.knobs.runtime
    return any(h is not None and getattr(h, "calls", True)
               for h in (runtime.launch_enter_hook, runtime.launch_exit_hook))
