"""The model runner with adapters: before each step, the manager maps tokens to slots.

`LoRAModelRunner` wraps whichever runner the engine got (model_runner.py or its GPU variant;
worker/wrapper.py) and adds one call before its `execute`: `LoRAModelManager.prepare_step` with
the scheduled sequences in the order the runner lays out their tokens (`step_order`).
Everything else is the wrapped runner's.

With CUDA graphs there are two sets of decode graphs in the runner's registry
(worker/cuda_graphs.py): the runner's own ("decode"), which replay the LoRA kernels (their
tiles read the step's mapping from device buffers, so one graph serves any mix of adapters),
and a second set captured without them ("lora-base"), replayed for a decode step whose tokens
have no adapter: an engine with `enable_lora` then serves base-model traffic at the base
model's speed (benchmarks/lora.py measures both).
"""
from __future__ import annotations

from minipaged.worker.cuda_graphs import DECODE, LORA_BASE, CUDAGraphRunner
from minipaged.worker.wrapper import RunnerWrapper


class LoRAModelRunner(RunnerWrapper):
    def __init__(self, runner, manager):
        super().__init__(runner)
        self.lora_manager = manager
        registry = runner.cuda_graphs
        decode = registry.get(DECODE) if registry is not None else None  # with the LoRA kernels
        self.has_base_graphs = decode is not None
        if decode is not None:
            registry.register(LORA_BASE, self.capture_base(decode))

    def capture_base(self, graphs: CUDAGraphRunner) -> CUDAGraphRunner:
        """The decode graphs again, captured with the LoRA kernels left out."""
        base = CUDAGraphRunner(graphs.model, graphs.kv_cache, graphs.backend,
                               max_num_seqs=graphs.max_bs, max_model_len=graphs.max_model_len,
                               block_size=graphs.block_size, device=graphs.device,
                               logits_max_batch=graphs.logits_max_batch)
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
        if self.has_base_graphs:  # a decode step replays the set that fits its tokens
            kwargs["decode_variant"] = DECODE if manager.punica.any_lora else LORA_BASE
        return self.runner.execute(sched, *args, **kwargs)
