"""One step's inputs, from the driver to the workers, as tensors (no pickled objects).

The driver builds the step exactly as on one device (`ModelRunner.prepare_inputs`); then

    header  (cpu_group, gloo, 16 int64 on the host)  what comes next and how long each part is
    payload (device_group, on the model's device)     the step's tensors, end to end, int64:

        input_ids | positions | slot_mapping | block_tables (num_seqs x width) | context_lens |
        cu_seqlens_q | sample_rows | blocks_to_copy (src, dst pairs)

Workers wait for the header between steps (for as long as the engine is idle), then receive
the payload into a tensor of the announced size and rebuild the same `AttentionMetadata`. A
header with op STOP ends a worker's loop.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as dist

from minipaged.attention import AttentionMetadata
from minipaged.distributed.parallel_state import TPGroup

HEADER_LEN = 16
STEP, STOP, SIZES = 1, 2, 3


@dataclass
class StepInputs:
    """What a worker needs to run the same forward as the driver."""

    input_ids: torch.Tensor  # (num_tokens,) int64
    positions: torch.Tensor  # (num_tokens,) int64
    metadata: AttentionMetadata
    sample_rows: list[int]
    blocks_to_copy: list[tuple[int, int]]
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)  # (gpu, cpu) pairs
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)  # (cpu, gpu) pairs


def send_header(cpu_group, op: int, *values: int) -> None:
    header = torch.zeros(HEADER_LEN, dtype=torch.int64)
    header[0] = op
    header[1:1 + len(values)] = torch.tensor(values, dtype=torch.int64)
    dist.broadcast(header, src=0, group=cpu_group)


def recv_header(tp: TPGroup) -> list[int]:
    header = torch.empty(HEADER_LEN, dtype=torch.int64)
    dist.broadcast(header, src=0, group=tp.cpu_group)
    return header.tolist()


def broadcast_step(tp: TPGroup, step: StepInputs) -> None:
    """Driver: announce the step's sizes, then send its tensors."""
    m = step.metadata
    num_seqs, width = m.block_tables.shape
    dev = step.input_ids.device
    pairs = step.blocks_to_copy + step.blocks_to_swap_out + step.blocks_to_swap_in
    host = torch.tensor(step.sample_rows + [i for pair in pairs for i in pair], dtype=torch.int64)
    payload = torch.cat([step.input_ids, step.positions, m.slot_mapping,
                         m.block_tables.reshape(-1).long(), m.context_lens.long(),
                         m.cu_seqlens_q.long(), host.to(dev)])
    send_header(tp.cpu_group, STEP, step.input_ids.shape[0], num_seqs, width, len(step.sample_rows),
                len(step.blocks_to_copy), m.max_query_len, m.max_context_len,
                m.num_decode_tokens, payload.shape[0], len(step.blocks_to_swap_out),
                len(step.blocks_to_swap_in))
    dist.broadcast(payload, src=0, group=tp.device_group)


def recv_step(tp: TPGroup, header: list[int], device: torch.device,
              block_size: int) -> StepInputs:
    """Worker: receive the step the header announced and rebuild its inputs."""
    (_, num_tokens, num_seqs, width, num_samples, num_copies, max_query_len, max_context_len,
     num_decode_tokens, total, num_swap_out, num_swap_in) = header[:12]
    payload = torch.empty(total, dtype=torch.int64, device=device)
    dist.broadcast(payload, src=0, group=tp.device_group)
    ids, pos, slots, tables, ctx, cu, host = payload.split(
        [num_tokens, num_tokens, num_tokens, num_seqs * width, num_seqs, num_seqs + 1,
         num_samples + 2 * (num_copies + num_swap_out + num_swap_in)])
    ctx_host, cu_host, host = ctx.tolist(), cu.tolist(), host.tolist()
    metadata = AttentionMetadata(
        slot_mapping=slots, block_tables=tables.view(num_seqs, width).int(),
        context_lens=ctx.int(), cu_seqlens_q=cu.int(),
        query_lens=[b - a for a, b in zip(cu_host, cu_host[1:])], context_lens_host=ctx_host,
        max_query_len=max_query_len, max_context_len=max_context_len, block_size=block_size,
        num_decode_tokens=num_decode_tokens)
    pairs = list(zip(host[num_samples::2], host[num_samples + 1::2]))
    swap_out = pairs[num_copies:num_copies + num_swap_out]
    return StepInputs(ids, pos, metadata, host[:num_samples], pairs[:num_copies], swap_out,
                      pairs[num_copies + num_swap_out:])


def broadcast_sizes(tp: TPGroup, *sizes: int) -> Optional[list[int]]:
    """Start-up numbers the driver decides for everyone (the KV cache's num_blocks, the swap
    pool's num_cpu_blocks)."""
    if tp.is_driver:
        send_header(tp.cpu_group, SIZES, *sizes)
        return list(sizes)
    header = recv_header(tp)
    if header[0] != SIZES:
        raise RuntimeError(f"expected the start-up sizes from the driver, got op {header[0]}")
    return header[1:1 + len(sizes)]
