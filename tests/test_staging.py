"""A GPU step's inputs on their way: the pinned staging buffers (worker/staging.py) and the
in-flight token gather of async scheduling (gpu_model_runner.in_flight_tokens), on the CPU;
tests/test_gpu.py runs the pinned copies on a GPU."""
import numpy as np
import pytest
import torch

from minipaged.worker.gpu_model_runner import in_flight_tokens
from minipaged.worker.staging import ALIGN_BYTES, StepStaging


def _stage(staging, values32, values64):
    staged = staging.stage([(torch.int32, len(values32)), (torch.int64, len(values64))])
    a, b = staged.host
    a[:] = values32
    b[:] = values64
    return staged


def test_parts_arrive_with_their_dtypes_and_alignment():
    staging = StepStaging(torch.device("cpu"))
    staged = _stage(staging, [1, 2, 3], [2**40, -5])
    starts = [start for start, _, _ in staged.spans]
    assert starts == [0, ALIGN_BYTES] and all(s % ALIGN_BYTES == 0 for s in starts)
    a, b = staged.to_device()
    assert a.dtype == torch.int32 and a.tolist() == [1, 2, 3]
    assert b.dtype == torch.int64 and b.tolist() == [2**40, -5]


def test_a_later_step_never_changes_an_earlier_steps_tensors():
    """The buffers are reused round-robin: what a step got must not alias them (on the CPU,
    copies; on a GPU, device memory)."""
    staging = StepStaging(torch.device("cpu"), num_slots=2)
    first = _stage(staging, [7] * 5, [8] * 3).to_device()
    for step in range(5):  # wraps around the two buffers twice, growing them once
        _stage(staging, [step] * (5 + 100 * step), [step] * 3).to_device()
    assert first[0].tolist() == [7] * 5 and first[1].tolist() == [8] * 3


def test_a_buffer_grows_for_a_larger_step():
    staging = StepStaging(torch.device("cpu"), num_slots=1)
    _stage(staging, [1], [1]).to_device()
    big = np.arange(10_000, dtype=np.int32)
    a, b = _stage(staging, big, [3, 4]).to_device()
    assert torch.equal(a, torch.from_numpy(big)) and b.tolist() == [3, 4]


@pytest.mark.parametrize("from_gpu, gpu_rows, n", [
    ([0, 1, 2], [0, 1, 2], 3),  # every row, same order: a slice of the tokens, no kernel
    ([1, 2], [3, 4], 4),  # a contiguous run: one copy
    ([0, 2], [1, 0], 3),  # anything else: a gather
    ([2], [5], 3),
])
def test_in_flight_tokens_matches_the_gather(from_gpu, gpu_rows, n):
    tokens = torch.arange(100, 106)
    ids = torch.full((n,), -1)
    expected = ids.index_copy(0, torch.tensor(from_gpu), tokens[torch.tensor(gpu_rows)])
    out = in_flight_tokens(ids.clone(), from_gpu, gpu_rows, torch.tensor(from_gpu),
                           torch.tensor(gpu_rows), tokens)
    assert torch.equal(out, expected)
