"""The model runner with adapters: before each step, the manager maps tokens to slots.

`LoRAModelRunner` wraps whichever runner the engine got (model_runner.py or its GPU variant)
and adds one call before its `execute`: `LoRAModelManager.prepare_step` with the scheduled
sequences in the order the runner lays out their tokens (`step_order`). Everything else is
the wrapped runner's.

With CUDA graphs it keeps two sets of decode graphs: the runner's own, which replay the LoRA
kernels (their tiles read the step's mapping from device buffers, so one graph serves any mix
of adapters), and a second set captured without them, replayed for a decode step whose tokens
have no adapter: an engine with `enable_lora` then serves base-model traffic at the base
model's speed (benchmarks/lora.py measures both).
"""
from __future__ import annotations


class LoRAModelRunner:
    def __init__(self, runner, manager):
        self.runner = runner
        self.lora_manager = manager
        self.lora_graphs = getattr(runner, "graph_runner", None)  # with the LoRA kernels
        self.base_graphs = None
        if self.lora_graphs is not None:
            self.base_graphs = self._capture_base(self.lora_graphs)

    def _capture_base(self, graphs):
        from minipaged.worker.cuda_graphs import CUDAGraphRunner
        base = CUDAGraphRunner(graphs.model, graphs.kv_cache, graphs.backend,
                               max_num_seqs=graphs.max_bs, max_model_len=graphs.max_model_len,
                               block_size=graphs.block_size, device=graphs.device)
        punica = self.lora_manager.punica
        punica.capturing_base = True
        try:
            base.capture()
        finally:
            punica.capturing_base = False
        return base

    def execute(self, sched, *args, **kwargs):
        manager = self.lora_manager
        manager.prepare_step(self.runner.step_order(sched))
        if self.base_graphs is not None:  # a decode step replays the set that fits its tokens
            self.runner.graph_runner = (self.lora_graphs if manager.punica.any_lora
                                        else self.base_graphs)
        return self.runner.execute(sched, *args, **kwargs)

    def __getattr__(self, name):  # kv_cache, device, graph_runner, ...: the wrapped runner's
        return getattr(self.runner, name)
