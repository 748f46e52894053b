"""LoRA adapters as a request extension (engine/extensions.py; lesson 11).

Attached when the engine is built with `enable_lora` (the layers get adapter slots and the
runner maps each step's tokens to them: manager.py, runner.py; `add_request` checks a request's
`LoRARequest` and reads its adapter: engine/processor.py). After the plan:

    adapters of the step that the CPU cache dropped are read again; if one's folder
    cannot be read any more, its requests fail alone before the forward (freeing their blocks
    withdraws what the step would have written from the prefix cache).
"""
from __future__ import annotations

from minipaged.engine.extensions import RequestExtension


class LoRAExtension(RequestExtension):
    def __init__(self, manager):
        self.manager = manager  # LoRAModelManager

    def after_plan(self, engine, sched) -> None:
        failed = self.manager.read_dropped({s.seq.lora_int_id for s in sched.scheduled})
        if not failed:
            return
        for s in sched.scheduled:
            if s.seq.lora_int_id in failed:
                engine.fail_before_forward(s.seq, failed[s.seq.lora_int_id])
        sched.scheduled = [s for s in sched.scheduled if s.seq.lora_int_id not in failed]
