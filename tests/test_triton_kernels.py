"""The Triton paged-attention kernels against the `torch_ref` oracle.

On a machine without a GPU they run under the Triton interpreter (tests/conftest.py sets
TRITON_INTERPRET=1 before minipaged is imported), so sizes are small; on CUDA the same tests run
the compiled kernels. Every case uses shuffled physical blocks, and every cache slot that holds no
real key is filled with NaN: a kernel that reads past a sequence's end, or a masked lane it should
not touch, turns the output into NaN and fails.
"""
from __future__ import annotations

import math
from dataclasses import astuple

import pytest
import torch

from tests.helpers import IGNORE_INTERPRETER_WARNINGS, store_and_attend, triton_device

DEVICE = triton_device()  # skips this module where Triton kernels cannot run

from minipaged.attention import get_attention_backend  # noqa: E402
from minipaged.attention import triton_kernels as tk  # noqa: E402
from minipaged.attention.metadata import AttentionMetadata  # noqa: E402
from minipaged.attention.torch_ref import TorchRefBackend, paged_attention_reference  # noqa: E402
from minipaged.worker.gpu_model_runner import GPUModelRunner  # noqa: E402
from minipaged.attention.triton_backend import TritonBackend  # noqa: E402

pytestmark = IGNORE_INTERPRETER_WARNINGS

# |out - ref| <= atol + rtol * |ref|; the reference computes in fp32 and rounds once.
TOL = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}


class Case:
    """One step: sequences given as (query_len, context_len), a paged cache with shuffled blocks.

    Block 0 is never handed out (the block tables' padding points at it) and, like every slot past
    a sequence's end and every slot this step is about to write, holds NaN.
    """

    def __init__(self, seqs, block_size, num_heads, num_kv_heads, head_dim, dtype,
                 pad_tokens=0, seed=0, fill=float("nan")):
        g = torch.Generator().manual_seed(seed)
        self.block_size, self.dtype = block_size, dtype
        qlens = [q for q, _ in seqs]
        ctxs = [c for _, c in seqs]
        blocks_per_seq = [-(-c // block_size) for c in ctxs]
        num_blocks = 1 + sum(blocks_per_seq) + 2  # null block 0, two spare blocks
        physical = (1 + torch.randperm(num_blocks - 1, generator=g)).tolist()  # shuffled
        max_blocks = max(blocks_per_seq) + 1  # one column of padding too
        tables = torch.zeros(len(seqs), max_blocks, dtype=torch.int32)
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self.k_cache = torch.full(shape, fill, dtype=dtype)
        self.v_cache = torch.full(shape, fill, dtype=dtype)
        slots, start = [], 0
        for i, (q_len, ctx) in enumerate(seqs):
            own = physical[start:start + blocks_per_seq[i]]
            start += blocks_per_seq[i]
            tables[i, :len(own)] = torch.tensor(own, dtype=torch.int32)
            pos = torch.arange(ctx)
            seq_slots = torch.tensor(own)[pos // block_size] * block_size + pos % block_size
            cached = seq_slots[:ctx - q_len]  # keys from earlier steps (prefix) are in the cache
            n = len(cached)
            self.k_cache.view(-1, num_kv_heads, head_dim)[cached] = _randn(g, n, num_kv_heads, head_dim, dtype)
            self.v_cache.view(-1, num_kv_heads, head_dim)[cached] = _randn(g, n, num_kv_heads, head_dim, dtype)
            slots.append(seq_slots[ctx - q_len:])  # this step's tokens
        slot_mapping = torch.cat(slots + [torch.full((pad_tokens,), -1)]).long()
        num_tokens = len(slot_mapping)
        self.q = _randn(g, num_tokens, num_heads, head_dim, dtype)
        self.k = _randn(g, num_tokens, num_kv_heads, head_dim, dtype)
        self.v = _randn(g, num_tokens, num_kv_heads, head_dim, dtype)
        self.num_real = sum(qlens)
        self.scale = 1.0 / math.sqrt(head_dim)
        cu = torch.zeros(len(seqs) + 1, dtype=torch.int32)
        cu[1:] = torch.tensor(qlens).cumsum(0)
        self.metadata = AttentionMetadata(
            slot_mapping=slot_mapping, block_tables=tables,
            context_lens=torch.tensor(ctxs, dtype=torch.int32), cu_seqlens_q=cu,
            query_lens=qlens, context_lens_host=ctxs, max_query_len=max(qlens),
            max_context_len=max(ctxs), block_size=block_size,
            num_decode_tokens=sum(1 for q in qlens if q == 1))
        self.to(DEVICE)

    def to(self, device):
        for name in ("k_cache", "v_cache", "q", "k", "v"):
            setattr(self, name, getattr(self, name).to(device))
        md = self.metadata
        for name in ("slot_mapping", "block_tables", "context_lens", "cu_seqlens_q"):
            setattr(md, name, getattr(md, name).to(device))

    def expected_caches(self):
        """The caches after this step's store, written with plain indexing."""
        kc, vc = self.k_cache.clone(), self.v_cache.clone()
        keep = self.metadata.slot_mapping >= 0
        slots = self.metadata.slot_mapping[keep]
        kc.view(-1, *kc.shape[2:])[slots] = self.k[keep]
        vc.view(-1, *vc.shape[2:])[slots] = self.v[keep]
        return kc, vc

    def expected(self):
        kc, vc = self.expected_caches()
        q = self.q[:self.num_real]
        return paged_attention_reference(q, kc, vc, self.metadata, self.scale)


def _randn(g, *shape_and_dtype):
    *shape, dtype = shape_and_dtype
    return torch.randn(*shape, generator=g).to(dtype)


def assert_close(out, ref, dtype):
    out, ref = out.float(), ref.float()
    assert not out.isnan().any(), "NaN in the kernel's output: it read an unwritten slot"
    torch.testing.assert_close(out, ref, atol=TOL[dtype], rtol=TOL[dtype])


def run_kernels(case: Case, num_splits: int, config=None):
    """store_kv + paged_attention, launched directly (the functional API of triton_kernels)."""
    md = case.metadata
    tk.store_kv(case.k, case.v, case.k_cache, case.v_cache, md.slot_mapping)
    group = case.q.shape[1] // case.k_cache.shape[2]
    interpret = DEVICE == "cpu"
    if config is None:
        config = (tk.decode_config(case.q.shape[2], group, interpret) if md.max_query_len == 1 else
                  tk.prefill_config(case.q.shape[2], group, md.max_query_len, interpret))
    return tk.paged_attention(case.q, case.k_cache, case.v_cache, md.block_tables,
                              md.context_lens, md.cu_seqlens_q, case.scale, num_seqs=md.num_seqs,
                              max_query_len=md.max_query_len, config=config,
                              num_splits=num_splits)


# ------------------------------------------------------------------------------------- store
@pytest.mark.parametrize("num_kv_heads,head_dim,dtype", [
    (4, 8, torch.float32), (2, 128, torch.bfloat16), (8, 64, torch.float16), (3, 24, torch.float32),
])
def test_store_kv_writes_every_slot_and_skips_padding(num_kv_heads, head_dim, dtype):
    case = Case([(3, 10), (1, 17), (9, 9)], block_size=8, num_heads=num_kv_heads,
                num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=dtype, pad_tokens=3)
    kc, vc = case.expected_caches()
    tk.store_kv(case.k, case.v, case.k_cache, case.v_cache, case.metadata.slot_mapping)
    # bit for bit, NaN slots included: a padding token (slot -1) must not have written anywhere
    torch.testing.assert_close(case.k_cache, kc, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(case.v_cache, vc, rtol=0, atol=0, equal_nan=True)


# ------------------------------------------------------------------------------------ decode
DECODE_SHAPES = [  # block_size, num_heads, num_kv_heads, head_dim, dtype
    pytest.param(8, 8, 4, 8, torch.float32, id="stories260K-bs8-fp32"),
    pytest.param(16, 8, 8, 128, torch.bfloat16, id="mha-d128-bs16-bf16"),
    pytest.param(16, 16, 8, 128, torch.bfloat16, id="qwen3-gqa2-d128-bs16-bf16"),
    pytest.param(128, 16, 2, 64, torch.float16, id="gqa8-d64-bs128-fp16"),
    pytest.param(32, 6, 2, 40, torch.float32, id="gqa3-d40-bs32-fp32"),
    pytest.param(16, 4, 2, 256, torch.bfloat16, id="gqa2-d256-bs16-bf16"),
]


@pytest.mark.parametrize("block_size,num_heads,num_kv_heads,head_dim,dtype", DECODE_SHAPES)
@pytest.mark.parametrize("num_splits", [1, 4])
def test_decode_matches_reference(block_size, num_heads, num_kv_heads, head_dim, dtype, num_splits):
    # context lengths at the edges: 1, one block, one block + 1, and a few hundred
    lens = [1, block_size, block_size + 1, 300]
    case = Case([(1, n) for n in lens], block_size, num_heads, num_kv_heads, head_dim, dtype,
                pad_tokens=2, seed=num_splits)
    out = run_kernels(case, num_splits)
    assert_close(out[:case.num_real], case.expected(), dtype)


@pytest.mark.parametrize("seqs", [[(1, 70), (1, 9), (1, 33)], [(20, 20), (5, 40), (1, 17)]],
                         ids=["decode", "prefill"])
def test_head_major_cache_gives_the_same_results(seqs):
    """The GPU engine stores each (block, KV head) contiguously and hands the kernels a transposed
    view (kv_cache.allocate_kv_cache(head_major=True)); they follow its strides."""
    case = Case(seqs, 16, 8, 4, 32, torch.float32, pad_tokens=1)
    expected, (kc, vc) = case.expected(), case.expected_caches()
    nb, bs, heads, dim = case.k_cache.shape
    for name in ("k_cache", "v_cache"):
        token_major = getattr(case, name)
        head_major = torch.empty(nb, heads, bs, dim, dtype=token_major.dtype,
                                 device=token_major.device).transpose(1, 2).copy_(token_major)
        setattr(case, name, head_major)
    out = run_kernels(case, num_splits=1)
    assert_close(out[:case.num_real], expected, torch.float32)
    for cache, want in ((case.k_cache, kc), (case.v_cache, vc)):  # the stores follow them too
        torch.testing.assert_close(cache, want, rtol=0, atol=0, equal_nan=True)


def test_decode_more_splits_than_key_tiles():
    # 16 splits of a 20-key context: most parts are empty and must weigh nothing in the merge
    case = Case([(1, 20), (1, 3)], 8, 4, 2, 16, torch.float32)
    out = run_kernels(case, num_splits=16)
    assert_close(out, case.expected(), torch.float32)


@pytest.mark.parametrize("num_splits", [1, 4])
def test_decode_padding_sequence_with_no_keys_gives_zeros(num_splits):
    # CUDA-graph padding rows: query length 1, context length 0, slot -1. Nothing is read, the
    # output row is 0 (not NaN), and the real sequences are unaffected.
    case = Case([(1, 70), (1, 1)], 8, 4, 2, 16, torch.float32, pad_tokens=1)
    md = case.metadata
    md.cu_seqlens_q = torch.arange(4, dtype=torch.int32, device=DEVICE)
    md.context_lens = torch.tensor([70, 1, 0], dtype=torch.int32, device=DEVICE)
    md.block_tables = torch.cat([md.block_tables, torch.zeros_like(md.block_tables[:1])])
    md.query_lens, md.context_lens_host = [1, 1, 1], [70, 1, 0]
    tk.store_kv(case.k, case.v, case.k_cache, case.v_cache, md.slot_mapping)
    config = tk.decode_config(16, 2, DEVICE == "cpu")
    out = tk.paged_attention(case.q, case.k_cache, case.v_cache, md.block_tables,
                             md.context_lens, md.cu_seqlens_q, case.scale, num_seqs=3,
                             max_query_len=1, config=config, num_splits=num_splits)
    assert torch.equal(out[2], torch.zeros_like(out[2]))
    md.query_lens, md.context_lens_host = [1, 1], [70, 1]  # the reference knows no empty rows
    md.cu_seqlens_q, md.context_lens = md.cu_seqlens_q[:3], md.context_lens[:2]
    assert_close(out[:2], paged_attention_reference(case.q[:2], case.k_cache, case.v_cache, md,
                                                    case.scale), torch.float32)


# ----------------------------------------------------------------------------------- prefill
PREFILL_SHAPES = [
    pytest.param(8, 8, 4, 8, torch.float32, id="stories260K-bs8-fp32"),
    pytest.param(16, 16, 8, 128, torch.bfloat16, id="qwen3-gqa2-d128-bs16-bf16"),
    pytest.param(128, 16, 2, 64, torch.float16, id="gqa8-d64-bs128-fp16"),
    pytest.param(16, 2, 1, 256, torch.float32, id="gqa2-d256-bs16-fp32"),
]


@pytest.mark.parametrize("block_size,num_heads,num_kv_heads,head_dim,dtype", PREFILL_SHAPES)
def test_mixed_prefill_and_decode_matches_reference(block_size, num_heads, num_kv_heads,
                                                    head_dim, dtype):
    seqs = [
        (37, 37),  # a fresh prompt
        (1, 150),  # a decode
        (block_size + 1, block_size + 1),  # a prompt one token into its second block
        (5, 5 + 2 * block_size),  # prefix-cache hit: two cached blocks, five new tokens
        (20, 90),  # a chunk of a chunked prefill: 70 keys cached by earlier chunks
        (1, 1),  # a decode with a single key
    ]
    case = Case(seqs, block_size, num_heads, num_kv_heads, head_dim, dtype, pad_tokens=3)
    out = run_kernels(case, num_splits=1)
    assert_close(out[:case.num_real], case.expected(), dtype)


@pytest.mark.parametrize("block_m,block_n", [(64, 64), (16, 16)])
def test_prefill_with_splits_and_long_query(block_m, block_n):
    # split-KV also works for query tiles; a 70-token query spans several tiles (GQA 4: 16 rows
    # hold 4 tokens, 64 rows 16 tokens)
    case = Case([(70, 200), (2, 2)], 16, 4, 1, 32, torch.float32)
    config = tk.KernelConfig(block_m=block_m, block_n=block_n, num_warps=4, num_stages=2)
    out = run_kernels(case, num_splits=4, config=config)
    assert_close(out, case.expected(), torch.float32)


# ----------------------------------------------------------------------------------- backend
@pytest.mark.parametrize("seqs", [
    pytest.param([(1, 40), (1, 9), (1, 1)], id="decode-only"),
    pytest.param([(12, 30), (1, 9), (4, 4)], id="mixed"),
    pytest.param([(1, 40), (1, 9), (12, 30), (4, 4)], id="decodes-first"),
])
def test_backend_forward_equals_torch_ref_backend(seqs):
    # torch_ref gathers whole padded rows and masks scores afterwards, so its unused slots must
    # hold finite garbage (1e4) rather than NaN here.
    case = Case(seqs, 8, 8, 4, 8, torch.float32, pad_tokens=2, fill=1e4)
    ref_case = Case(seqs, 8, 8, 4, 8, torch.float32, pad_tokens=2, fill=1e4)
    ref_backend, backend = TorchRefBackend(), get_attention_backend("triton", DEVICE)
    assert isinstance(backend, TritonBackend) and backend.name == "triton"
    md = case.metadata
    ref_md = ref_case.metadata
    ref_backend.prepare(ref_md)
    backend.prepare(md)
    for layer in range(2):  # the plan is shared by the layers of a step
        ref = store_and_attend(ref_backend, ref_case.q, ref_case.k, ref_case.v, ref_case.k_cache,
                               ref_case.v_cache, ref_md, case.scale)
        out = store_and_attend(backend, case.q, case.k, case.v, case.k_cache, case.v_cache, md,
                               case.scale)
        n = case.num_real
        assert_close(out[:n], ref[:n], torch.float32)
    torch.testing.assert_close(case.k_cache, ref_case.k_cache, rtol=0, atol=0)
    torch.testing.assert_close(case.v_cache, ref_case.v_cache, rtol=0, atol=0)


@pytest.mark.parametrize("num_splits", [None, 4])
def test_mixed_step_with_decodes_first_attends_in_two_launches(num_splits):
    """Decodes at the front of a mixed step get the decode tiles, the prompts the prefill tiles,
    each launch over its slice of the sequences (with split-KV, each merge touches only its own
    rows); a decode after a prompt keeps one launch."""
    first = Case([(1, 70), (1, 9), (30, 30), (5, 21)], 8, 8, 4, 16, torch.float32, pad_tokens=1)
    backend = TritonBackend(num_splits=num_splits)
    backend.prepare(first.metadata)
    out = store_and_attend(backend, first.q, first.k, first.v, first.k_cache, first.v_cache,
                           first.metadata, first.scale)
    assert_close(out[:first.num_real], first.expected(), torch.float32)
    plan = first.metadata.plan
    decodes, prompts = next(iter(plan.launches.values()))
    assert [decodes.part, prompts.part] == plan.parts
    # (first_seq, num_seqs, tokens, max_query_len, max_context_len)
    assert astuple(decodes.part) == (0, 2, (0, 2), 1, 70)
    assert astuple(prompts.part) == (2, 2, (2, 37), 30, 30)
    assert decodes.config == tk.decode_config(16, 2, DEVICE == "cpu")
    after = Case([(30, 30), (1, 9)], 8, 8, 4, 16, torch.float32)
    backend.prepare(after.metadata)
    store_and_attend(backend, after.q, after.k, after.v, after.k_cache, after.v_cache,
                     after.metadata, after.scale)
    assert [astuple(p) for p in after.metadata.plan.parts] == [(0, 2, None, 30, 30)]
    assert len(next(iter(after.metadata.plan.launches.values()))) == 1


def test_choose_num_splits_fills_the_gpu_and_keeps_keys_per_split():
    decode = tk.KernelConfig(block_m=16, block_n=64, num_warps=2, num_stages=3)
    # a big batch already fills 132 SMs: no split
    assert tk.choose_num_splits(256 * 8, 4096, decode, num_sms=132) == 1
    # one sequence, 8 KV heads: split, into a power of two
    s = tk.choose_num_splits(8, 4096, decode, num_sms=132)
    assert s > 1 and s & (s - 1) == 0
    # never more parts than key tiles: 100 keys are two tiles of 64
    assert tk.choose_num_splits(8, 100, decode, num_sms=132) == 2
    assert tk.choose_num_splits(8, 64, decode, num_sms=132) == 1


# -------------------------------------------------------------------------------- end to end
def _stories260k_available():
    try:
        from minipaged import LLM  # noqa: F401
        from minipaged.models.loader import resolve_model
        resolve_model("stories260K")
    except (ImportError, FileNotFoundError):
        return False
    return True


@pytest.mark.skipif(not _stories260k_available(), reason="minipaged.LLM or stories260K not found")
def test_stories260k_greedy_tokens_equal_torch_ref():
    from minipaged import LLM, SamplingParams

    prompts = ["Once upon a time", "The little dog", "Lily wanted to"]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    tokens = {}
    for backend in ("torch_ref", "triton"):
        llm = LLM("stories260K", attention_backend=backend, num_blocks=64, block_size=8)
        assert llm.engine.backend.name == backend
        outs = llm.generate(prompts, params, use_tqdm=False)
        tokens[backend] = [list(o.outputs[0].token_ids) for o in outs]
    assert all(len(t) == 8 for t in tokens["triton"])
    assert tokens["triton"] == tokens["torch_ref"]


@pytest.mark.skipif(not _stories260k_available(), reason="minipaged.LLM or stories260K not found")
def test_engine_with_the_gpu_choices_equals_torch_ref():
    """What the engine does differently on CUDA, forced on the CPU: the head-major cache, the batch
    ordered decodes first then longest first, and split-KV in every launch. A small token budget
    with chunked prefill makes mixed steps (decodes + prompt chunks: two launches). Greedy tokens
    equal the torch_ref backend's."""
    from minipaged import LLM, SamplingParams
    from minipaged.worker.kv_cache import allocate_kv_cache

    prompts = ["Once upon a time", "The little dog ran to the park and saw a big", "Lily",
               "One day, a girl named Sue went to the store with her mom. They"]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    kwargs = dict(num_blocks=64, block_size=8, max_num_batched_tokens=12,
                  enable_chunked_prefill=True)
    ref = LLM("stories260K", attention_backend="torch_ref", **kwargs)
    want = [list(o.outputs[0].token_ids) for o in ref.generate(prompts, params, use_tqdm=False)]
    llm = LLM("stories260K", attention_backend="triton", **kwargs)
    eng = llm.engine
    eng.kv_cache = allocate_kv_cache(eng.model_config, eng.num_blocks, 8, eng.kv_dtype,
                                     eng.device, head_major=True)
    eng.model_runner = GPUModelRunner(eng.model, eng.kv_cache, eng.backend, 8, max_num_seqs=256,
                                      max_model_len=512, cuda_graphs=False)  # decodes first
    eng.backend.num_splits = 4
    got = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == want
    mixed = [r for r in llm.trace
             if any(e.num_decode_tokens for e in r.scheduled)
             and any(e.num_prefill_tokens > 1 for e in r.scheduled)]
    assert mixed, "no step mixed decodes with prompt chunks"


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(16, 8, 128), (32, 8, 128),
                                                             (8, 8, 64), (8, 1, 256)])
def test_kernel_variants_cover_every_launch_a_step_can_make(num_heads, num_kv_heads, head_dim):
    """What the GPU runner compiles at build (`compile_variants`) is every (tile config, split)
    that `_launches` can pick for any query length and context, and every reduction factor."""
    variants = TritonBackend.kernel_variants(num_heads, num_kv_heads, head_dim)
    compiled = {(c, ns > 1) for c, _, ns in variants}
    reductions = {ns for _, _, ns in variants if ns > 1}
    group = num_heads // num_kv_heads
    needed_configs = {tk.decode_config(head_dim, group, False)}
    needed_configs |= {tk.prefill_config(head_dim, group, q, False) for q in range(2, 9000)}
    for config in needed_configs:
        assert {(config, False), (config, True)} <= compiled, config
    for programs in (1, 3, 8, 40, 132, 1000):
        for context in (1, 100, 4096, 100_000):
            ns = tk.choose_num_splits(programs, context, tk.decode_config(head_dim, group, False),
                                      132, 64)
            assert ns == 1 or ns in reductions, (programs, context, ns)


def test_compile_variants_launches_each_variant_without_touching_the_cache():
    backend = TritonBackend()
    k_cache = torch.randn(4, 16, 2, 32, device=DEVICE)  # (num_blocks, block_size, kv heads, dim)
    v_cache = torch.randn(4, 16, 2, 32, device=DEVICE)
    before = (k_cache.clone(), v_cache.clone())
    n = backend.compile_variants(4, k_cache, v_cache, torch.float32)
    assert n == len(TritonBackend.kernel_variants(4, 2, 32)) > 7
    assert torch.equal(k_cache, before[0]) and torch.equal(v_cache, before[1])
