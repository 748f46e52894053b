"""A runner that adds one thing to another runner's step, and hands everything else to it.

Capabilities that change how a step runs wrap the engine's runner (model_runner.py, or one of
its variants) once, when the engine is built (lessons 06, 09, 11):

    lora/runner.py        LoRAModelRunner    maps the step's tokens to adapter slots first
    worker/tp_worker.py   TPDriverRunner     broadcasts the step to the tensor-parallel workers
    swap/runner.py        SwapModelRunner    moves swapped blocks between the GPU and the CPU pool
    prompt_logprobs/runner.py  PromptLogprobsRunner  the logits of scored prompts' rows too
                                                     (innermost; every single-device engine)

`RunnerWrapper` delegates every method and attribute the engine, the step loops and the tests
use, each written out: a reader finds what a wrapper changes by reading its class, and a name
the wrapped runner lacks fails here rather than somewhere deep inside it. `innermost(runner)`
is the runner they all wrap.
"""
from __future__ import annotations

import torch


class RunnerWrapper:
    def __init__(self, runner):
        self.runner = runner  # the runner (or wrapper) this one adds its step to

    # --- the pipeline: order, inputs, forward, logits, and all of them in one step -------------
    def step_order(self, sched) -> list:
        return self.runner.step_order(sched)

    def prepare_inputs(self, sched, *pending):
        return self.runner.prepare_inputs(sched, *pending)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata,
                *args) -> torch.Tensor:  # args: the GPU runner's decode_variant
        return self.runner.forward(input_ids, positions, metadata, *args)

    def compute_logits(self, hidden: torch.Tensor, sample_rows: list[int]) -> torch.Tensor:
        return self.runner.compute_logits(hidden, sample_rows)

    def execute(self, sched, *args, **kwargs) -> torch.Tensor:
        return self.runner.execute(sched, *args, **kwargs)

    # --- what the runner holds -----------------------------------------------------------------
    @property
    def model(self):
        return self.runner.model

    @property
    def kv_cache(self) -> torch.Tensor:
        return self.runner.kv_cache

    @property
    def backend(self):
        return self.runner.backend

    @property
    def block_size(self) -> int:
        return self.runner.block_size

    @property
    def device(self) -> torch.device:
        return self.runner.device

    @property
    def cuda_graphs(self):
        """The wrapped runner's `CUDAGraphs` (worker/cuda_graphs.py), or None."""
        return self.runner.cuda_graphs


def innermost(runner):
    """The runner at the centre of `runner`'s wrappers: the one that runs the model."""
    while isinstance(runner, RunnerWrapper):
        runner = runner.runner
    return runner
