"""Adapters in a fixed number of device slots, loaded on demand, evicted least recently used.

`LoRAModelManager` (vLLM's name) does three jobs, all on behalf of the engine:

* at build: wraps the model's linear layers in `LoRALinear` (layers.py), with `max_loras`
  slots each, and picks the punica variant: the Triton kernels on CUDA, torch elsewhere;
* per request (`add_adapter`): reads and checks the PEFT folder once (adapter.py), keeping its
  tensors on the CPU, keyed by `lora_int_id`;
* per step (`prepare_step`): makes sure each adapter of the scheduled sequences sits in a slot
  (a free one, or the least recently used slot whose adapter this step does not need), and
  gives the punica wrapper the slot of every token, in the order of the runner's input_ids.

The scheduler never runs more distinct adapters in one step than there are slots
(engine/scheduler.py: a request whose adapter finds no slot waits), so a slot can always be
found.
"""
from __future__ import annotations

from collections import OrderedDict

import torch

from minipaged.lora.adapter import MODULE_SLICES, LoRAAdapter, load_adapter, module_shapes
from minipaged.lora.layers import LoRALinear
from minipaged.lora.punica import PunicaWrapper, TritonPunicaWrapper
from minipaged.lora.request import LoRARequest


class LoRAModelManager:
    def __init__(self, model, model_config, *, max_loras: int, max_lora_rank: int,
                 max_num_tokens: int, device: torch.device, dtype: torch.dtype):
        from minipaged.models.llama import LlamaForCausalLM
        if type(model) is not LlamaForCausalLM:
            raise ValueError(f"enable_lora is not supported with {type(model).__name__} yet "
                             "(tensor parallelism): use tensor_parallel_size=1")
        self.model_config = model_config
        self.max_loras, self.max_lora_rank = max_loras, max_lora_rank
        wrapper = TritonPunicaWrapper if device.type == "cuda" else PunicaWrapper
        self.punica = wrapper(max_loras, max_num_tokens, device)
        self.layers: dict[tuple[int, str], LoRALinear] = {}  # (layer, stacked name) -> layer
        shapes = module_shapes(model_config)
        for i, layer in enumerate(model.model.layers):
            for parent in (layer.self_attn, layer.mlp):
                for name, slices in MODULE_SLICES.items():
                    if not hasattr(parent, name):
                        continue
                    lora = LoRALinear(getattr(parent, name), [shapes[m][1] for m in slices],
                                      shapes[slices[0]][0], max_loras, max_lora_rank,
                                      self.punica, dtype, device)
                    setattr(parent, name, lora)
                    self.layers[(i, name)] = lora
        self.adapters: dict[int, LoRAAdapter] = {}  # lora_int_id -> weights on the CPU
        self.slot_of: OrderedDict[int, int] = OrderedDict()  # loaded ids, least recent first
        self.free_slots = list(range(max_loras - 1, -1, -1))
        self.num_loads = 0  # adapters copied into a slot (a reload after eviction counts again)
        self.num_evictions = 0

    # --- requests ---------------------------------------------------------------------------
    def add_adapter(self, req: LoRARequest) -> LoRAAdapter:
        """Read and check `req`'s adapter (once per lora_int_id); raises ValueError."""
        known = self.adapters.get(req.lora_int_id)
        if known is not None:
            if (known.name, known.path) != (req.lora_name, req.lora_path):
                raise ValueError(f"lora_int_id={req.lora_int_id} is already adapter "
                                 f"{known.name!r} ({known.path}); {req.lora_name!r} "
                                 f"({req.lora_path}) needs an id of its own")
            return known
        adapter = load_adapter(req.lora_name, req.lora_int_id, req.lora_path,
                               self.model_config, self.max_lora_rank)
        self.adapters[req.lora_int_id] = adapter
        return adapter

    # --- the step ---------------------------------------------------------------------------
    def prepare_step(self, entries) -> None:
        """`entries`: the step's ScheduledSeqs in the runner's token order."""
        needed = {e.seq.lora_int_id for e in entries} - {0}
        if len(needed) > self.max_loras:
            raise RuntimeError(f"{len(needed)} adapters scheduled in one step, but max_loras="
                               f"{self.max_loras} (the scheduler should have kept them waiting)")
        for lora_id in needed:
            self._activate(lora_id, needed)
        token_lora: list[int] = []
        for e in entries:
            lora_id = e.seq.lora_int_id
            token_lora += [self.slot_of[lora_id] if lora_id else -1] * e.num_new_tokens
        self.punica.update(token_lora)

    def _activate(self, lora_id: int, needed: set[int]) -> None:
        if lora_id in self.slot_of:
            self.slot_of.move_to_end(lora_id)  # most recently used
            return
        if self.free_slots:
            slot = self.free_slots.pop()
        else:  # evict the least recently used adapter that this step does not run
            victim = next(i for i in self.slot_of if i not in needed)
            slot = self.slot_of.pop(victim)
            self.num_evictions += 1
        adapter = self.adapters[lora_id]
        for (layer, name), lora in self.layers.items():
            lora.set_slot(slot, [adapter.weights.get((layer, m)) for m in MODULE_SLICES[name]])
        self.punica.scaling[slot] = adapter.scaling
        self.slot_of[lora_id] = slot
        self.num_loads += 1

    def wrap_runner(self, runner):
        from minipaged.lora.runner import LoRAModelRunner
        return LoRAModelRunner(runner, self)
