"""How the engine's block manager and scheduler are put together (issue #34's seams).

The core classes (`BlockManager`, `Scheduler`: lessons 02 and 03) know nothing of the later
capabilities. Each capability that changes their rules lives in its own folder and is attached
here, once, when the engine is built; one that is off costs nothing, since nothing of it is in
the class that runs:

    n > 1, beam search   groups/scheduling.py   GroupScheduling: seats, gangs (always: any request
                                                may ask for several sequences)
    enable_lora          lora/scheduling.py     LoRAAdmission (`max_loras` adapters at once), and
                                                the adapter id as the prefix cache's extra key
    preemption "swap"    swap/                  SwapPreemption, SwapBlockManager (a CPU pool)

A step loop that plans differently passes its own `Scheduler` subclass as `base`
(worker/async_scheduling.py, spec_decode/scheduler.py); the mixins go on top of it.
"""
from __future__ import annotations

import functools

from minipaged.engine.block_manager import BlockManager
from minipaged.engine.scheduler import Scheduler
from minipaged.groups.scheduling import GroupScheduling
from minipaged.lora.scheduling import LoRAAdmission, lora_hash_key
from minipaged.swap.block_manager import SwapBlockManager
from minipaged.swap.scheduler import SwapPreemption


def build_block_manager(num_blocks: int, block_size: int, enable_prefix_caching: bool = True, *,
                        enable_lora: bool = False, num_cpu_blocks: int = 0,
                        preemption_mode: str = "recompute") -> BlockManager:
    """The KV cache's `BlockManager`: with a CPU pool of `num_cpu_blocks` for swap preemption,
    keying the prefix cache by adapter with `enable_lora`."""
    extra_key = lora_hash_key if enable_lora else None
    if preemption_mode == "swap":
        return SwapBlockManager(num_blocks, block_size, enable_prefix_caching, extra_key,
                                num_cpu_blocks=num_cpu_blocks)
    return BlockManager(num_blocks, block_size, enable_prefix_caching, extra_key)


def build_scheduler(block_manager: BlockManager, *, max_num_seqs: int,
                    max_num_batched_tokens: int, enable_chunked_prefill: bool = True,
                    preemption_mode: str = "recompute", max_loras: int = 0,
                    base: type[Scheduler] = Scheduler, **extra) -> Scheduler:
    """`base` (the core `Scheduler` or a step loop's subclass) with the policies these knobs
    turn on; `max_loras` 0: no adapters. `extra`: keywords of `base`."""
    mixins: list[type] = []
    if preemption_mode == "swap":
        mixins.append(SwapPreemption)
    if max_loras:
        mixins.append(LoRAAdmission)
        extra["max_loras"] = max_loras
    mixins.append(GroupScheduling)
    cls = compose(base, tuple(mixins))
    return cls(block_manager, max_num_seqs=max_num_seqs,
               max_num_batched_tokens=max_num_batched_tokens,
               enable_chunked_prefill=enable_chunked_prefill, **extra)


@functools.lru_cache(maxsize=None)
def compose(base: type, mixins: tuple[type, ...]) -> type:
    """One class: `mixins` (first: outermost) over `base`, made once per combination."""
    if not mixins:
        return base
    name = f"{base.__name__}[{', '.join(m.__name__ for m in mixins)}]"
    return type(name, mixins + (base,), {"__module__": __name__})
