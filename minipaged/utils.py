"""Small helpers shared by several rooms of the package (no state, no policy)."""
from __future__ import annotations

from typing import Optional

import torch


def cdiv(a: int, b: int) -> int:
    """Ceiling division: how many blocks of `b` hold `a` items."""
    return -(-a // b)


def to_device(values, device: torch.device, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """Small host data (a list or numpy array) as a tensor on `device`, copied without making the
    host wait for the GPU: `torch.tensor(values, device="cuda")`, or a copy from ordinary pageable
    memory, can wait for every kernel already queued; a copy from pinned memory does not."""
    t = torch.as_tensor(values, dtype=dtype)
    if device.type != "cuda":
        return t
    return t.pin_memory().to(device, non_blocking=True)


def last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    """`t`, or a copy whose last dimension is contiguous (what the Triton kernels index)."""
    return t if t.stride(-1) == 1 else t.contiguous()


def check_last_dim_contiguous(**tensors: torch.Tensor) -> None:
    """Raise, naming the tensor, unless each last dimension is contiguous (written in place)."""
    for name, t in tensors.items():
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must have a contiguous last dimension (head_dim); got "
                             f"strides {tuple(t.stride())}. Call .contiguous() first.")
