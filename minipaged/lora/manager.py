"""Adapters in a fixed number of device slots and a bounded CPU cache, both least recently used.

`LoRAModelManager` (vLLM's name) does three jobs, all on behalf of the engine:

* at build: wraps the model's linear layers in `LoRALinear` (layers.py), with `max_loras`
  slots each, and picks the punica variant: the Triton kernels on CUDA, torch elsewhere;
* per request (`add_adapter`): reads and checks the PEFT folder (adapter.py) unless its
  adapter is cached or in a slot, and keeps its tensors in the CPU cache (`adapters`, keyed by
  `lora_int_id`, at most `max_cpu_loras` of them);
* per step: `read_dropped` (the engine calls it once the step is planned) reads again the
  step's adapters that the CPU cache has dropped; `prepare_step` makes sure each adapter of the
  scheduled sequences sits in a slot (a free one, or the least recently used slot whose adapter
  this step does not need), and gives the punica wrapper the slot of every token, in the order
  of the runner's input_ids.

The CPU cache makes room by dropping, least recently used first (`cpu_victim`), an adapter no
live request runs and no slot holds; failing that, the CPU copy of one a slot holds (its
weights stay in the slot: the copy only serves to load it again); failing that, the copy of one
a waiting request runs: `read_dropped` reads it again before the step that schedules the
request (LLMEngine.schedule), and if its folder is gone, its requests fail alone.

The scheduler never runs more distinct adapters in one step than there are slots
(engine/scheduler.py: a request whose adapter finds no slot waits), so a slot can always be
found, and (max_cpu_loras >= max_loras) the step's adapters fit in the CPU cache together.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Callable

import torch

from minipaged.lora.adapter import MODULE_SLICES, LoRAAdapter, load_adapter, module_shapes
from minipaged.lora.layers import LoRALinear
from minipaged.lora.punica import PunicaWrapper
from minipaged.lora.request import LoRARequest


def cpu_victim(lru_order: list[int], in_slot, live: set[int]) -> int:
    """The adapter whose CPU copy goes first: `lru_order` lists the candidates, least recently
    used first; `in_slot` holds the ids on the device, `live` those unfinished requests run."""
    for tier in ([i for i in lru_order if i not in in_slot and i not in live],  # unneeded
                 [i for i in lru_order if i in in_slot],  # its weights stay in the slot
                 lru_order):  # a waiting request's: read again when it is scheduled
        if tier:
            return tier[0]
    raise RuntimeError("the LoRA CPU cache has no adapter to drop")


class LoRAModelManager:
    def __init__(self, model, model_config, *, max_loras: int, max_lora_rank: int,
                 max_num_tokens: int, device: torch.device, dtype: torch.dtype,
                 max_cpu_loras: int, live_lora_ids: Callable[[], set[int]] = set):
        from minipaged.models.llama import LlamaForCausalLM
        if type(model) is not LlamaForCausalLM:
            raise ValueError(f"enable_lora is not supported with {type(model).__name__} yet "
                             "(tensor parallelism): use tensor_parallel_size=1")
        self.model_config = model_config
        self.max_loras, self.max_lora_rank = max_loras, max_lora_rank
        self.max_cpu_loras = max_cpu_loras
        self.live_lora_ids = live_lora_ids  # the adapters of the engine's unfinished requests
        wrapper = PunicaWrapper
        if device.type == "cuda":  # the Triton kernels (defined on import: CUDA only)
            from minipaged.lora.triton_punica import TritonPunicaWrapper as wrapper
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
        # The CPU cache: lora_int_id -> weights, least recently used first, <= max_cpu_loras.
        self.adapters: OrderedDict[int, LoRAAdapter] = OrderedDict()
        self.known: dict[int, LoRARequest] = {}  # every id seen: one adapter per id
        self.slot_of: OrderedDict[int, int] = OrderedDict()  # loaded ids, least recent first
        self.free_slots = list(range(max_loras - 1, -1, -1))
        self.num_loads = 0  # adapters copied into a slot (a reload after eviction counts again)
        self.num_evictions = 0  # from a slot
        self.num_reads = 0  # adapter folders read (again after the CPU cache dropped one)
        self.num_cpu_evictions = 0

    # --- requests ---------------------------------------------------------------------------
    def add_adapter(self, req: LoRARequest) -> None:
        """Read and check `req`'s adapter, unless the CPU cache or a slot holds it (it was
        checked then); raises ValueError."""
        lora_id = req.lora_int_id
        known = self.known.get(lora_id)
        if known is not None and (known.lora_name, known.lora_path) != (req.lora_name,
                                                                        req.lora_path):
            raise ValueError(f"lora_int_id={lora_id} is already adapter {known.lora_name!r} "
                             f"({known.lora_path}); {req.lora_name!r} ({req.lora_path}) needs "
                             "an id of its own")
        if lora_id in self.adapters:
            self.adapters.move_to_end(lora_id)  # most recently used
        elif lora_id not in self.slot_of:
            self._read(req)

    def _read(self, req: LoRARequest, keep: frozenset[int] = frozenset()) -> LoRAAdapter:
        """Read `req`'s folder into the CPU cache, first dropping what exceeds max_cpu_loras
        (never an adapter in `keep`: those the step being prepared loads)."""
        adapter = load_adapter(req.lora_name, req.lora_int_id, req.lora_path,
                               self.model_config, self.max_lora_rank)
        self.num_reads += 1
        self.known[req.lora_int_id] = req
        if len(self.adapters) >= self.max_cpu_loras:
            victim = cpu_victim([i for i in self.adapters if i not in keep], self.slot_of,
                                self.live_lora_ids())
            del self.adapters[victim]
            self.num_cpu_evictions += 1
        self.adapters[req.lora_int_id] = adapter
        return adapter

    def read_dropped(self, lora_ids: set[int]) -> dict[int, ValueError]:
        """Before a step: read again the adapters among `lora_ids` (the step's) that are neither
        in a slot nor in the CPU cache. Returns {lora_int_id: why} for folders that cannot be
        read any more (the engine fails their requests alone)."""
        needed = lora_ids - {0}
        if len(needed) > self.max_loras:  # (then they would not fit in the CPU cache either)
            raise RuntimeError(f"{len(needed)} adapters scheduled in one step, but max_loras="
                               f"{self.max_loras} (the scheduler should have kept them waiting)")
        failed: dict[int, ValueError] = {}
        keep = frozenset(needed)
        for lora_id in needed - set(self.slot_of) - set(self.adapters):
            req = self.known[lora_id]
            try:
                self._read(req, keep)
            except ValueError as e:
                failed[lora_id] = ValueError(f"LoRA adapter {req.lora_name!r} (lora_int_id="
                                             f"{lora_id}) was dropped from the CPU cache and "
                                             f"cannot be read again: {e}")
        return failed

    # --- the step ---------------------------------------------------------------------------
    def prepare_step(self, entries) -> None:
        """`entries`: the step's ScheduledSeqs in the runner's token order."""
        needed = {e.seq.lora_int_id for e in entries} - {0}
        failed = self.read_dropped(needed)  # (LLMEngine.schedule has read them already)
        if failed:
            raise RuntimeError(str(next(iter(failed.values()))))
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
        self.adapters.move_to_end(lora_id)
        adapter = self.adapters[lora_id]  # in the CPU cache: read_dropped saw to it
        if self.free_slots:
            slot = self.free_slots.pop()
        else:  # evict the least recently used adapter that this step does not run
            victim = next(i for i in self.slot_of if i not in needed)
            slot = self.slot_of.pop(victim)
            self.num_evictions += 1
        for (layer, name), lora in self.layers.items():
            lora.set_slot(slot, [adapter.weights.get((layer, m)) for m in MODULE_SLICES[name]])
        self.punica.scaling[slot] = adapter.scaling
        self.slot_of[lora_id] = slot
        self.num_loads += 1

    def wrap_runner(self, runner):
        from minipaged.lora.runner import LoRAModelRunner
        return LoRAModelRunner(runner, self)
