"""engine/build.py: the capabilities that change the scheduler's and block manager's rules are
composed in once, when the engine is built, and are absent from the classes when off."""
from minipaged import LLM
from minipaged.async_sched.step_loop import AsyncScheduler
from minipaged.engine.block_manager import BlockManager
from minipaged.engine.build import build_block_manager, build_scheduler
from minipaged.engine.scheduler import Scheduler
from minipaged.groups.scheduling import GroupScheduling
from minipaged.lora.scheduling import LoRAAdmission, lora_hash_key
from minipaged.swap.block_manager import SwapBlockManager
from minipaged.swap.scheduler import SwapPreemption

KW = dict(max_num_seqs=4, max_num_batched_tokens=8)


def test_off_capabilities_are_not_in_the_classes():
    bm = build_block_manager(16, 4)
    assert type(bm) is BlockManager and bm.extra_key is None
    sched = build_scheduler(bm, **KW)
    assert isinstance(sched, GroupScheduling)  # n > 1 and beams: any request may ask
    assert not isinstance(sched, (SwapPreemption, LoRAAdmission)) and not hasattr(sched, "swapped")


def test_capabilities_compose_over_a_step_loops_scheduler_once():
    bm = build_block_manager(16, 4, enable_lora=True, num_cpu_blocks=8, preemption_mode="swap")
    assert isinstance(bm, SwapBlockManager) and bm.extra_key is lora_hash_key
    make = lambda: build_scheduler(bm, preemption_mode="swap", max_loras=2, base=AsyncScheduler,
                                   max_model_len=64, **KW)
    sched = make()
    assert all(isinstance(sched, c) for c in (SwapPreemption, LoRAAdmission, GroupScheduling,
                                              AsyncScheduler, Scheduler))
    assert sched.max_loras == 2 and sched.max_model_len == 64
    assert type(make()) is type(sched)  # one class per combination


def test_the_engine_builds_what_its_config_asks_for():
    llm = LLM("stories260K", num_blocks=64, max_model_len=128, preemption_mode="swap",
              num_cpu_blocks=8)
    assert isinstance(llm.engine.block_manager, SwapBlockManager)
    assert isinstance(llm.engine.scheduler, SwapPreemption)
    assert llm.engine.block_manager.cpu_allocator.num_blocks == 8
