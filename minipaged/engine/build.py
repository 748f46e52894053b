"""How an engine is put together: the capabilities attached to the core, once, at build time.

The core (`BlockManager`, `Scheduler`, `ModelRunner`, `LLMEngine`'s step: lessons 02-04) knows
nothing of the later capabilities. Each lives in its own folder and is attached here, when the
engine is built (`LLMEngine.__init__` calls these functions); one that is off costs nothing,
since nothing of it is in the objects that run. The block manager's and the scheduler's rules:

    n > 1, beam search   groups/scheduling.py   GroupScheduling: seats, gangs (always: any request
                                                may ask for several sequences)
    enable_lora          lora/scheduling.py     LoRAAdmission (`max_loras` adapters at once), and
                                                the adapter id as the prefix cache's extra key
    preemption "swap"    swap/                  SwapPreemption, SwapBlockManager (a CPU pool)
    scheduling_policy    priority/scheduling.py PriorityScheduling: queues in priority order, a
    "priority"                                  more urgent request preempts less urgent ones

A step loop that plans differently passes its own `Scheduler` subclass as `base`
(async_sched/step_loop.py, spec_decode/scheduler.py); the mixins go on top of it. Beside them:

    tensor_parallel_size > 1   distributed/        the workers started, this rank's shard loaded
    quantization               models/quantization the linear layers replaced (a module transform)
    enable_lora                lora/               adapter slots around the linear layers, the
                                                   runner wrapped, a request extension
    structured outputs, n > 1  structured_output/, groups/   request extensions (extensions.py)
"""
from __future__ import annotations

import functools
import torch

from minipaged.engine.block_manager import BlockManager
from minipaged.engine.extensions import Extensions
from minipaged.engine.scheduler import Scheduler
from minipaged.groups.extension import GroupExtension
from minipaged.groups.scheduling import GroupScheduling
from minipaged.lora.extension import LoRAExtension
from minipaged.lora.scheduling import LoRAAdmission, lora_hash_key
from minipaged.models.loader import load_model
from minipaged.priority.scheduling import PriorityScheduling
from minipaged.structured_output.extension import StructuredOutputExtension
from minipaged.structured_output.manager import StructuredOutputManager
from minipaged.swap.block_manager import SwapBlockManager
from minipaged.swap.runner import SwapModelRunner
from minipaged.swap.scheduler import SwapPreemption
from minipaged.worker import make_model_runner
from minipaged.worker.swap import allocate_cpu_cache, determine_num_cpu_blocks


def build_model(config, source, dtype: torch.dtype, device: torch.device, backend,
                requests: dict):
    """(the model, its `ModelConfig`, the LoRA manager or None). With tensor parallelism the
    workers are started first (they load their shards too) and this process holds 1/N of every
    layer (lesson 09); `quantization` replaces the linear layers (lesson 11); `enable_lora`
    puts adapter slots around them (lora/manager.py), its CPU cache keeping the adapters of the
    unfinished `requests` (the engine's, by id) first."""
    tp = None
    if config.tensor_parallel_size > 1:
        from minipaged.distributed.launch import start_tensor_parallel
        tp = start_tensor_parallel(config, source)
    model, model_config = load_model(source, dtype, device, backend,
                                     max_positions=config.max_model_len, seed=config.seed,
                                     fused_ops=config.fused_ops, tp=tp,
                                     quantization=config.quantization)
    lora_manager = None
    if config.enable_lora:
        from minipaged.lora.manager import LoRAModelManager
        lora_manager = LoRAModelManager(
            model, model_config, max_loras=config.max_loras, max_lora_rank=config.max_lora_rank,
            max_cpu_loras=config.max_cpu_loras,
            max_num_tokens=max(config.max_num_batched_tokens, config.max_num_seqs),
            device=device, dtype=dtype,
            live_lora_ids=lambda: {s.lora_int_id for s in requests.values()} - {0})
    return model, model_config, lora_manager


def build_kv_block_manager(config, num_blocks: int, kv_cache: torch.Tensor, block_bytes: int):
    """(the engine's block manager, the CPU pool of swap preemption: a tensor, empty unless
    the config sizes one; worker/swap.py)."""
    num_cpu_blocks = determine_num_cpu_blocks(config, block_bytes, num_blocks)
    block_manager = build_block_manager(
        num_blocks, config.block_size, config.enable_prefix_caching,
        enable_lora=config.enable_lora, num_cpu_blocks=num_cpu_blocks,
        preemption_mode=config.preemption_mode)
    return block_manager, allocate_cpu_cache(kv_cache, num_cpu_blocks)


def build_runner(config, model, kv_cache: torch.Tensor, backend, lora_manager,
                 cpu_cache: torch.Tensor | None = None):
    """The model runner the config asks for (worker/__init__.py), wrapped (worker/wrapper.py)
    by the LoRA manager (each step's tokens mapped to adapter slots first) when adapters are
    on, and outermost by swap preemption (the swapped blocks moved first: swap/runner.py)."""
    runner = make_model_runner(config, model, kv_cache, backend)
    if lora_manager is not None:
        runner = lora_manager.wrap_runner(runner)
    if config.preemption_mode == "swap":
        runner = SwapModelRunner(runner, cpu_cache)
    return runner


def build_extensions(engine) -> tuple[Extensions, StructuredOutputExtension]:
    """The request extensions of `engine` (extensions.py), each idle while no request uses it:
    grammar masks (lesson 12), LoRA adapters (lesson 11), n > 1 and beam search (lesson 06).
    Returns them and the structured-output one (the engine keeps its manager)."""
    manager = StructuredOutputManager(engine.tokenizer, engine.model_config.vocab_size,
                                      engine.eos_token_ids, engine.config.max_num_seqs)
    structured = StructuredOutputExtension(manager)
    lora = [] if engine.lora_manager is None else [LoRAExtension(engine.lora_manager)]
    return Extensions([structured, *lora, GroupExtension(engine)]), structured


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
                    scheduling_policy: str = "fcfs", base: type[Scheduler] = Scheduler,
                    **extra) -> Scheduler:
    """`base` (the core `Scheduler` or a step loop's subclass) with the policies these knobs
    turn on; `max_loras` 0: no adapters. `extra`: keywords of `base`."""
    mixins: list[type] = []
    if scheduling_policy == "priority":
        mixins.append(PriorityScheduling)
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
