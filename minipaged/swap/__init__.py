"""Swap preemption (lesson 06, `preemption_mode="swap"`): a preempted sequence's KV blocks go to a
CPU pool instead of being dropped, and come back before any new request is admitted.

    block_manager.py  SwapBlockManager: the CPU pool's blocks and the swapped-out block tables
    scheduler.py      SwapPreemption: the scheduler's preemption mode and the swap-in pass
    runner.py         SwapModelRunner: the step's swapped blocks copied before its forward
    worker/swap.py    the copies themselves (the CPU tensor, out and back in a few transfers)

engine/build.py attaches them when the config asks for swap; with recompute nothing here runs.
"""
