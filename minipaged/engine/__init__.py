"""The host side of the engine: what lessons 02-04 and 06 read, top-down.

    llm_engine.py      `LLMEngine`: add requests, `step()` in public phases, outputs
    step_loop.py       the step-loop seam and `SyncStepLoop`, the phases in order
    scheduler.py       which sequences run this step and how many tokens each; preemption
    sequence.py        a request's tokens and state machine
    block_manager.py   the paged KV cache's bookkeeping: block tables, copy-on-write, prefix cache
    block_allocator.py the physical blocks: free queue, ref counts, prefix-hash index
    output.py          stop checks, detokenizing, `RequestOutput`
    processor.py       a request's prompt and parameters checked against the model before queueing
    build.py           an engine put together: the capabilities attached through their seams
    extensions.py      the request-extension seam
    failures.py        a request that raises while it is stepped fails alone
    trace.py           one `StepRecord` per step, for the lessons' plots
    block_usage.py     a block manager's accounting (`block_usage`) and its `check_invariants`
    beam_search.py     the old import path of groups/beam_search.py

Nothing here touches the GPU: the worker (`minipaged/worker/`) turns a `SchedulerOutput` into
tensors and logits.
"""
