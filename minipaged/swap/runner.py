"""Swap preemption in the runner (lesson 06): the step's swapped blocks move before its forward.

`SwapModelRunner` wraps the engine's runner (worker/wrapper.py) when `preemption_mode="swap"`
and adds one thing before its `execute`: the blocks the scheduler swapped out this step are
copied to the CPU pool, then the swapped-in ones back into their fresh GPU blocks
(worker/swap.py does the copies). Both happen before the wrapped runner's copy-on-writes and
its forward, since GPU blocks freed by a swap-out may be rewritten by this very step. With
tensor parallelism the driver's runner sends the same lists to every worker, which copies its
own shard (worker/tp_worker.py).
"""
from __future__ import annotations

import torch

from minipaged.worker.swap import swap_in_blocks, swap_out_blocks
from minipaged.worker.wrapper import RunnerWrapper


class SwapModelRunner(RunnerWrapper):
    def __init__(self, runner, cpu_cache: torch.Tensor):
        super().__init__(runner)
        self.cpu_cache = cpu_cache  # (layers, 2, num_cpu_blocks, ...): the CPU pool

    def swap(self, sched) -> None:
        """Copy the step's swapped-out blocks to the CPU pool, then its swapped-in ones back."""
        swap_out_blocks(self.kv_cache, self.cpu_cache, sched.blocks_to_swap_out)
        swap_in_blocks(self.cpu_cache, self.kv_cache, sched.blocks_to_swap_in)

    def execute(self, sched, *args, **kwargs) -> torch.Tensor:
        self.swap(sched)
        return self.runner.execute(sched, *args, **kwargs)
