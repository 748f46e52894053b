"""Shared test set-up.

Triton kernels run under the CPU interpreter when no GPU is present; the variable must be set
before any Triton kernel is defined, so it is set here, before the tests import minipaged.
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# The test models are tiny (stories260K is 64 wide): a second CPU thread buys little, and when
# other processes share the cores, OpenMP threads waiting for each other slow every layer down
# many times over (see minipaged.lessons.figures.cpu_threads).
torch.set_num_threads(1)
