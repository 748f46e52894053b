"""The host side of the engine: what lessons 02-04 and 06 read, top-down.

    llm_engine.py     `LLMEngine`: add requests, `step()`, outputs (the loop every front end drives)
    scheduler.py      which sequences run this step and how many tokens each; preemption
    block_manager.py  the paged KV cache's bookkeeping: block tables, ref counts, prefix cache
    sequence.py       a request's tokens and state machine; `SequenceGroup` for n > 1 and beams
    output.py         stop checks, detokenizing, `RequestOutput`
    processor.py      a request's prompt and parameters checked against the model before queueing
    failures.py       a request that raises while it is stepped fails alone
    beam_search.py    beam search's rules (Hugging Face's), on top of sequence groups
    trace.py          one `StepRecord` per step, for the lessons' plots
    block_usage.py    a block manager's accounting (`block_usage`) and self-check (`check_invariants`)

Nothing here touches the GPU: the worker (`minipaged/worker/`) turns a `SchedulerOutput` into
tensors and logits.
"""
