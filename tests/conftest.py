"""Shared test set-up.

Triton kernels run under the CPU interpreter when no GPU is present; the variable must be set
before any Triton kernel is defined, so it is set here, before the tests import minipaged.
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
