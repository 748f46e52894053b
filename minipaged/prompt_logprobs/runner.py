"""The runner wrapper of prompt logprobs: a step's prompt rows turned into logits (lesson 04).

A forward computes a hidden state for every token of the step, and the runner turns only the
rows that sample into logits (worker/model_runner.py). `PromptLogprobsRunner` wraps the
engine's runner (worker/wrapper.py), innermost, so the wrappers around it (LoRA's slot mapping,
swap's copies) still run first. While no request is being scored (`scoring` is empty) it hands
every step to the runner it wraps, unchanged. A step that holds prompt tokens of a request being
scored runs the same pipeline (copy-on-write, inputs, forward, the sampling rows' logits), then
the logits of those prompt rows, at most `slice_rows` rows at a time: a row is a whole
vocabulary of floats (stories260K: 512 x 4 bytes; Qwen3: 151,936 x 4 bytes, 0.6 MB), so a
2,048-token prompt would hold 1.2 GB at once.

The rows of a sequence are found through the wrapped runner's own layout: its entries in
`step_order(sched)`, each taking `num_new_tokens` rows. Position p's row scores prompt token
p + 1, and only positions the sequence has not scored yet are computed, so a prompt split
across chunks (chunked prefill) is scored chunk by chunk, and one prefilled again after a
recompute preemption is not scored twice.
"""
from __future__ import annotations

import torch

from minipaged.engine.sequence import Sequence
from minipaged.prompt_logprobs.compute import logprob_entries
from minipaged.worker.kv_cache import copy_blocks
from minipaged.worker.wrapper import RunnerWrapper


class PromptLogprobsRunner(RunnerWrapper):
    def __init__(self, runner, slice_rows: int = 256):
        super().__init__(runner)
        # request id -> its sequence, while its prompt is being scored (the request extension
        # adds it, extension.py; removed here once scored, or there when aborted)
        self.scoring: dict[str, Sequence] = {}
        self.slice_rows = slice_rows

    @torch.inference_mode()
    def execute(self, sched, *args, **kwargs) -> torch.Tensor:
        """`args`: the pending step of async scheduling; `kwargs`: LoRA's decode_variant."""
        plan = self.plan(sched) if self.scoring else None
        if plan is None:  # the common case: nothing of this step is scored
            return self.runner.execute(sched, *args, **kwargs)
        copy_blocks(self.kv_cache, sched.blocks_to_copy)
        input_ids, positions, metadata, sample_rows = self.runner.prepare_inputs(sched, *args)
        variant = [kwargs["decode_variant"]] if "decode_variant" in kwargs else []
        hidden = self.runner.forward(input_ids, positions, metadata, *variant)  # (tokens, hidden)
        logits = self.runner.compute_logits(hidden, sample_rows)  # (num_sampling_rows, vocab)
        self.score(hidden, *plan)
        return logits

    def plan(self, sched):
        """(rows, target token ids, top-k per row, [(sequence, rows it owns)]) of the prompt
        positions this step computes and nobody has scored yet; None if there are none."""
        for rid in [rid for rid, seq in self.scoring.items() if seq.is_finished]:
            del self.scoring[rid]  # failed or aborted before its prompt was scored
        rows: list[int] = []
        targets: list[int] = []
        owners: list[tuple[Sequence, int]] = []
        offset = 0  # the entry's first row in the step's flat token layout
        for s in self.runner.step_order(sched):
            seq = s.seq
            if self.scoring.get(seq.request_id) is seq:
                start, scored = seq.num_computed_tokens, len(seq.prompt_logprobs)
                if start > scored - 1:  # a prefix-cache hit would leave such a gap
                    raise RuntimeError(f"{seq!r} starts at position {start}, but only "
                                       f"{scored} of its prompt positions are scored")
                first = scored - 1  # position whose row scores the first unscored token
                end = min(start + s.num_new_tokens, seq.num_prompt_tokens - 1)
                if end > first:
                    rows += range(offset + first - start, offset + end - start)
                    targets += seq.prompt_token_ids[first + 1:end + 1]
                    owners.append((seq, end - first))
            offset += s.num_new_tokens
        if not owners:
            return None
        ks = [seq.sampling_params.prompt_logprobs for seq, n in owners for _ in range(n)]
        return rows, targets, ks, owners

    def score(self, hidden: torch.Tensor, rows: list[int], targets: list[int], ks: list[int],
              owners: list[tuple[Sequence, int]]) -> None:
        """Append each owner's new entries; a sequence whose prompt is now scored leaves
        `scoring` and may read the prefix cache again (a later recompute needs only K/V)."""
        entries = []
        for a in range(0, len(rows), self.slice_rows):
            b = a + self.slice_rows
            logits = self.runner.compute_logits(hidden, rows[a:b])  # (<= slice_rows, vocab)
            entries += logprob_entries(logits, targets[a:b], ks[a:b])
        i = 0
        for seq, n in owners:
            seq.prompt_logprobs += entries[i:i + n]
            i += n
            if len(seq.prompt_logprobs) == seq.num_prompt_tokens:
                del self.scoring[seq.request_id]
                seq.skip_reading_prefix_cache = False


def scoring_requests(runner):
    """The `scoring` registry of the `PromptLogprobsRunner` among `runner`'s wrappers, or None
    if there is none (tensor parallelism: see extension.py)."""
    while runner is not None:
        if isinstance(runner, PromptLogprobsRunner):
            return runner.scoring
        runner = getattr(runner, "runner", None)
    return None
