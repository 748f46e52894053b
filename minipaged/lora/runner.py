"""The model runner with adapters: before each step, the manager maps tokens to slots.

`LoRAModelRunner` wraps whichever runner the engine got (model_runner.py or its GPU variant)
and adds one call before its `execute`: `LoRAModelManager.prepare_step` with the scheduled
sequences in the order the runner lays out their tokens (`step_order`). Everything else is
the wrapped runner's.
"""
from __future__ import annotations


class LoRAModelRunner:
    def __init__(self, runner, manager):
        self.runner = runner
        self.lora_manager = manager

    def execute(self, sched, *args, **kwargs):
        self.lora_manager.prepare_step(self.runner.step_order(sched))
        return self.runner.execute(sched, *args, **kwargs)

    def __getattr__(self, name):  # kv_cache, device, graph_runner, ...: the wrapped runner's
        return getattr(self.runner, name)
