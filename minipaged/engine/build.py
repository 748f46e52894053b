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

The step loop (engine/step_loop.py) is chosen here too (`step_loop_class`); one that plans
differently passes its own `Scheduler` subclass as `base` (async_sched/step_loop.py,
spec_decode/scheduler.py), and the mixins go on top of it. Beside them:

    tensor_parallel_size > 1   distributed/        the workers started, this rank's shard loaded
    quantization               models/quantization the linear layers replaced (a module transform)
    enable_lora                lora/               adapter slots around the linear layers, the
                                                   runner wrapped, a request extension
    structured outputs, n > 1  structured_output/, groups/   request extensions (extensions.py)
    prompt_logprobs            prompt_logprobs/    a request extension, and the runner wrapped
                                                   (the prompt rows' logits of scored requests)
"""
from __future__ import annotations

import functools
import torch

from minipaged.engine.block_manager import BlockManager
from minipaged.engine.extensions import Extensions
from minipaged.engine.scheduler import Scheduler
from minipaged.engine.step_loop import StepLoop, SyncStepLoop
from minipaged.groups.extension import GroupExtension
from minipaged.groups.scheduling import GroupScheduling
from minipaged.lora.extension import LoRAExtension
from minipaged.lora.scheduling import LoRAAdmission, lora_hash_key
from minipaged.models.loader import load_model
from minipaged.prompt_logprobs.extension import PromptLogprobsExtension
from minipaged.prompt_logprobs.runner import PromptLogprobsRunner, scoring_requests
from minipaged.priority.scheduling import PriorityScheduling
from minipaged.sampling import Sampler
from minipaged.sampling.kernel_sampler import KernelSampler
from minipaged.structured_output.extension import StructuredOutputExtension
from minipaged.structured_output.manager import StructuredOutputManager
from minipaged.swap.block_manager import SwapBlockManager
from minipaged.swap.runner import SwapModelRunner
from minipaged.swap.scheduler import SwapPreemption
from minipaged.worker import make_model_runner
from minipaged.worker.kv_cache import (allocate_kv_cache, block_bytes, determine_num_blocks,
                                       kv_cache_torch_dtype)
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


def build_kv_cache(config, model, backend, kv_config, dtype: torch.dtype, device: torch.device):
    """(the KV cache tensor, its dtype, the bytes of one block): as many blocks as the memory
    knobs allow (worker/kv_cache.py); on CUDA after a dummy forward at the largest step has
    measured the activations' peak (gpu_model_runner.profile_peak_memory)."""
    kv_dtype = kv_cache_torch_dtype(config.kv_cache_dtype, dtype)
    profile = None
    if config.is_cuda:
        from minipaged.worker.gpu_model_runner import profile_peak_memory
        profile = functools.partial(profile_peak_memory, model, backend, kv_config, config,
                                    kv_dtype, device)
    num_blocks = determine_num_blocks(config, kv_config, kv_dtype, device, profile=profile)
    kv_cache = allocate_kv_cache(kv_config, num_blocks, config.block_size, kv_dtype, device,
                                 head_major=config.kv_head_major)
    return kv_cache, kv_dtype, block_bytes(kv_config, config.block_size, kv_dtype)


def settle(config) -> None:
    """The last of an engine's set-up. On CUDA, the garbage collector's heap is frozen: a
    collection pause idles the GPU (lesson 08 measures it; gpu_model_runner.freeze_gc_heap)."""
    if config.is_cuda:
        from minipaged.worker.gpu_model_runner import freeze_gc_heap
        freeze_gc_heap()


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
    innermost by prompt logprobs (the prompt rows' logits of scored requests, idle while there
    are none; not with tensor parallelism: prompt_logprobs/extension.py), by the LoRA manager
    (each step's tokens mapped to adapter slots first) when adapters are on, and outermost by
    swap preemption (the swapped blocks moved first: swap/runner.py)."""
    runner = make_model_runner(config, model, kv_cache, backend)
    if config.tensor_parallel_size == 1:
        runner = PromptLogprobsRunner(runner)
    if lora_manager is not None:
        runner = lora_manager.wrap_runner(runner)
    if config.preemption_mode == "swap":
        runner = SwapModelRunner(runner, cpu_cache)
    return runner


def build_extensions(engine) -> tuple[Extensions, StructuredOutputExtension]:
    """The request extensions of `engine` (extensions.py), each idle while no request uses it:
    grammar masks (lesson 12), LoRA adapters (lesson 11), n > 1 and beam search (lesson 06),
    prompt logprobs (lesson 04, with the runner's registry of the requests it scores).
    Returns them and the structured-output one (the engine keeps its manager)."""
    manager = StructuredOutputManager(engine.tokenizer, engine.model_config.vocab_size,
                                      engine.eos_token_ids, engine.config.max_num_seqs)
    structured = StructuredOutputExtension(manager)
    lora = [] if engine.lora_manager is None else [LoRAExtension(engine.lora_manager)]
    scoring = PromptLogprobsExtension(scoring_requests(engine.model_runner))
    return Extensions([structured, *lora, GroupExtension(engine), scoring]), structured


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


def step_loop_class(config) -> type[StepLoop]:
    """The step loop a resolved config asks for: the names of the capabilities that bring
    their own loop appear here, and nowhere else."""
    if config.speculative_config is not None:  # propose, verify, roll back (lesson 10)
        from minipaged.spec_decode.step_loop import SpecDecodeStepLoop
        return SpecDecodeStepLoop
    if config.async_scheduling:  # plan step t+1 while the GPU runs step t (lesson 08)
        from minipaged.async_sched.step_loop import AsyncStepLoop
        return AsyncStepLoop
    return SyncStepLoop


def build_engine_scheduler(config, block_manager: BlockManager, loop_cls) -> Scheduler:
    """The engine's scheduler: its step loop's class (`loop_cls.scheduler_cls`) with the
    policies the config turns on."""
    return build_scheduler(block_manager, max_num_seqs=config.max_num_seqs,
                           max_num_batched_tokens=config.max_num_batched_tokens,
                           enable_chunked_prefill=config.enable_chunked_prefill,
                           preemption_mode=config.preemption_mode,
                           max_loras=config.max_loras if config.enable_lora else 0,
                           scheduling_policy=config.scheduling_policy,
                           base=loop_cls.scheduler_cls, **loop_cls.scheduler_kwargs(config))


def build_sampler(config, eos_token_ids: list[int]) -> Sampler:
    """The torch `Sampler`, or on CUDA the `KernelSampler` (fused Triton draws, lesson 04)."""
    cls = KernelSampler if config.sampler_kernel else Sampler
    return cls(seed=config.seed, eos_token_ids=eos_token_ids)


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
