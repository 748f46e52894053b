"""float8 e4m3's numbers, shared by fp8.py's layers and fp8_triton.py's kernel (lesson 11).

A leaf: the torch definition and the Triton kernel both read these, and neither imports the
other's module for them.
"""
from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # e4m3fn's largest finite value
AMAX_FLOOR = 1e-12  # an all-zero row gets this instead of 0 (scale 0 would divide by zero)
