"""LoRA in the scheduler and the prefix cache (lesson 11): the two rules adapters add.

* Admission: at most `max_loras` distinct adapters run at once (their weight slots). A waiting
  request whose adapter would be one too many waits; the ones behind it may go (vLLM's rule).
  `LoRAAdmission` is a mixin over the `Scheduler` (engine/scheduler.py) that answers its
  `can_admit` seam; engine/build.py composes it in when `enable_lora` is set.
* The prefix cache: the same tokens under another adapter (or none) have other K/V, so a block's
  hash mixes in the adapter's id (`lora_hash_key`, the block manager's `extra_key`).
"""
from __future__ import annotations

from typing import Optional

from minipaged.engine.sequence import Sequence


def lora_hash_key(seq: Sequence) -> int:
    """The block manager's extra hash key: the sequence's adapter id (0: the base model)."""
    return seq.lora_int_id


class LoRAAdmission:
    """Mixin over `Scheduler`: a waiting sequence is admitted only if its adapter is running
    already, or one more adapter still has a slot."""

    def __init__(self, *args, max_loras: int, **kwargs):
        super().__init__(*args, **kwargs)
        self.max_loras = max_loras
        # The adapter ids of the running sequences (0 left out); None: to be counted again.
        self.running_loras: Optional[set[int]] = None

    def can_admit(self, seq: Sequence) -> bool:
        lora_id = seq.lora_int_id
        if not lora_id:
            return super().can_admit(seq)
        if self.running_loras is None:
            self.running_loras = {s.lora_int_id for s in self.running} - {0}
        loras = self.running_loras
        return (lora_id in loras or len(loras) < self.max_loras) and super().can_admit(seq)

    def enter_running(self, seq: Sequence) -> None:
        super().enter_running(seq)
        if self.running_loras is not None and seq.lora_int_id:
            self.running_loras.add(seq.lora_int_id)

    def leave_running(self, seq: Sequence) -> None:
        super().leave_running(seq)
        self.running_loras = None
