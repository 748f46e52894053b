"""Async scheduling (lesson 08): a step loop that plans step t+1 while the GPU runs step t.

    step_loop.py   `AsyncStepLoop` (the loop), `AsyncScheduler` (tokens in flight),
                   `PendingStep` / `DeferredStep` (a step's tokens on their way to the host)
"""
