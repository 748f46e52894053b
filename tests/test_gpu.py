"""GPU-only checks (skipped without CUDA; run on the GPU machine, see docs/guides/gpu.md).

Greedy parity with HF on the GPU path: Triton kernels, CUDA-graph decode replays, GPU sampling.
"""
import copy
import random

import pytest
import torch

from minipaged import LLM, SamplingParams
from minipaged.lessons.baseline import load_hf_model
from minipaged.models.loader import resolve_builtin
from minipaged.sampling.kernel_sampler import KernelSampler, kernel_applies
from tests.helpers import make_tiny_hf_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _greedy_hf(model, prompts, n):
    outs = []
    with torch.no_grad():
        for ids in prompts:
            x = torch.tensor([ids], device=model.device)
            y = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n,
                               do_sample=False, pad_token_id=0, eos_token_id=-1)
            outs.append(y[0, len(ids):].tolist())
    return outs


def _prompts(n, vocab, seed):
    rng = random.Random(seed)
    return [[1] + [rng.randrange(3, vocab) for _ in range(rng.randint(2, 80))] for _ in range(n)]


@pytest.mark.parametrize("enforce_eager", [True, False])
def test_stories260k_fp32_parity_on_gpu(enforce_eager):
    import gc
    gc.collect()
    torch.cuda.empty_cache()  # engines of earlier tests hold GPU memory until collected
    hf = load_hf_model(str(resolve_builtin("stories260K")), torch.float32, "cuda")
    prompts = _prompts(48, 512, 0)
    llm = LLM("stories260K", device="cuda", block_size=16, max_num_seqs=64,
              enforce_eager=enforce_eager, gpu_memory_utilization=0.05)
    assert llm.engine.backend.name == "triton"
    assert (llm.engine.model_runner.cuda_graphs.get("decode") is None) == enforce_eager
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=48, ignore_eos=True),
                        use_tqdm=False)
    got = [o.outputs[0].token_ids for o in outs]
    assert got == _greedy_hf(hf, prompts, 48)


def test_graphs_equal_eager_bf16_qwen3(tmp_path):
    make_tiny_hf_model("qwen3", tmp_path / "q3", dtype=torch.float32)
    prompts = _prompts(40, 97, 1)
    sp = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    res = []
    for eager in (True, False):
        llm = LLM(str(tmp_path / "q3"), dtype="bfloat16", device="cuda", max_num_seqs=48,
                  enforce_eager=eager, num_blocks=512)
        res.append([o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)])
        del llm
    assert res[0] == res[1]


def test_programmatic_dependent_launch_changes_no_token(tmp_path, monkeypatch):
    """With PDL each kernel of a step may start before the one ahead of it ends
    (kernel_launch.py); a kernel that read its input before waiting would read stale or half
    written memory. Greedy tokens of one and two streams (the GEMV's rows) and of a batch,
    replayed from CUDA graphs, are the same with PDL on and off."""
    from minipaged.kernel_launch import launch_pdl
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("PDL needs compute capability 9.0")
    make_tiny_hf_model("qwen3", tmp_path / "q3", dtype=torch.float32)
    sp = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    res = {}
    for pdl in ("1", "0"):
        monkeypatch.setenv("MINIPAGED_PDL", pdl)
        assert launch_pdl(torch.device("cuda")) == (pdl == "1")
        llm = LLM(str(tmp_path / "q3"), dtype="bfloat16", device="cuda", max_num_seqs=16,
                  num_blocks=256)
        res[pdl] = [[o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
                    for prompts in (_prompts(1, 97, 2), _prompts(2, 97, 3), _prompts(12, 97, 4))]
        del llm
    assert res["1"] == res["0"]


def test_preemption_on_gpu_fp32(tmp_path):
    hf = make_tiny_hf_model("llama", tmp_path / "m", dtype=torch.float32).to("cuda")
    prompts = _prompts(16, 97, 2)
    llm = LLM(str(tmp_path / "m"), dtype="float32", device="cuda", block_size=16, num_blocks=24,
              max_model_len=256)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=60, ignore_eos=True),
                        use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == _greedy_hf(hf, prompts, 60)
    assert sum(len(r.preempted) for r in llm.trace) > 0


def test_sampling_kernel_matches_softmax_on_gpu():
    from minipaged.sampling import Sampler
    from minipaged.engine.sequence import Sequence
    logits = torch.tensor([1.0, 0.2, -0.5, 0.8, -1.5, 0.0], device="cuda")
    n = 60_000
    seq = Sequence("r", [1], SamplingParams(temperature=0.7))
    sampler = KernelSampler(seed=3)  # what a CUDA engine builds (sampler_kernel)
    assert kernel_applies([seq.sampling_params])
    tokens = sampler.sample(logits.repeat(n, 1), [seq] * n)
    counts = torch.bincount(tokens.cpu(), minlength=6).double()
    probs = (logits.cpu().double() / 0.7).softmax(-1)
    chi2 = float(((counts - probs * n) ** 2 / (probs * n)).sum())
    assert chi2 < 30.0, (counts / n, probs)  # 5 degrees of freedom: P(chi2 > 30) ~ 1.5e-5
    # Qwen3's vocabulary in bf16, live tokens in different 2,048-token chunks: the chunk is
    # drawn first, then the token inside it
    live = torch.tensor([5, 2047, 2048, 70_000, 70_001, 151_935])
    values = torch.tensor([0.3, 1.0, -0.2, 0.8, 0.0, 0.5])
    big = torch.full((151_936,), float("-inf"))
    big[live] = values
    big = big.to("cuda", torch.bfloat16)
    n = 20_000
    tokens = sampler.sample(big.repeat(n, 1), [seq] * n).cpu()
    assert set(tokens.tolist()) <= set(live.tolist())
    counts = torch.bincount(tokens, minlength=151_936)[live].double()
    probs = (values.to(torch.bfloat16).double() / 0.7).softmax(-1)
    chi2 = float(((counts - probs * n) ** 2 / (probs * n)).sum())
    assert chi2 < 30.0, (counts / n, probs)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_same_step_prefix_hits_on_gpu(async_scheduling):
    """8 requests of one 100-token prompt arriving together (CUDA graphs, Triton kernels): the
    later ones hit the first one's 6 full blocks in the same step (published at allocation,
    filled by that forward before any attention reads them) and equal HF."""
    import gc
    gc.collect()
    torch.cuda.empty_cache()
    hf = load_hf_model(str(resolve_builtin("stories260K")), torch.float32, "cuda")
    prompt = [1] + [(7 * i) % 509 + 3 for i in range(99)]
    llm = LLM("stories260K", device="cuda", block_size=16, enable_prefix_caching=True,
              gpu_memory_utilization=0.05, async_scheduling=async_scheduling)
    outs = llm.generate([prompt] * 8, SamplingParams(temperature=0, max_tokens=32,
                                                     ignore_eos=True), use_tqdm=False)
    assert [e.num_cached_tokens for e in llm.trace[0].scheduled] == [0] + [96] * 7
    assert [o.outputs[0].token_ids for o in outs] == _greedy_hf(hf, [prompt], 32) * 8


def test_no_attention_kernel_compiles_after_the_engine_is_built(tmp_path):
    """The runner compiles every attention variant at build (`TritonBackend.compile_variants`):
    prefix hits (short queries over long contexts), mixed steps of a few tokens, long prompts,
    split-KV decodes and CUDA-graph replays then compile nothing while requests are served."""
    from triton import knobs
    make_tiny_hf_model("qwen3", tmp_path / "q3", dtype=torch.float32)
    llm = LLM(str(tmp_path / "q3"), dtype="bfloat16", device="cuda", max_num_seqs=32,
              num_blocks=1024, block_size=16, enable_prefix_caching=True,
              max_num_batched_tokens=512)
    compiled = []
    knobs.runtime.jit_cache_hook = lambda **kw: compiled.append(kw["fn"].name) and False
    try:
        rng = random.Random(3)
        shared = [rng.randrange(3, 97) for _ in range(180)]  # the tiny model's context is 256
        prompts = [shared + [rng.randrange(3, 97) for _ in range(rng.randint(1, 40))]
                   for _ in range(12)] + _prompts(12, 97, 4) + [shared]
        sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
        llm.generate(prompts, sp, use_tqdm=False)
        llm.generate([shared] + prompts[:3], sp, use_tqdm=False)  # whole-prompt hits
    finally:
        knobs.runtime.jit_cache_hook = None
    hits = [e.num_cached_tokens for r in llm.trace for e in r.scheduled]
    assert max(hits) >= 176  # the shared prefix's 11 full blocks were found
    assert [n for n in compiled if "attention" in n or "splits" in n] == []


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_prompt_logprobs_on_gpu_equal_hf(async_scheduling):
    """Prompt logprobs on the GPU path (CUDA graphs for the decodes around them, the GPU
    runner's step order, chunked prefill): equal to HF's log-softmax within 1e-4 (fp32)."""
    from tests.test_prompt_logprobs import STORIES, check_against_hf
    import gc
    gc.collect()
    torch.cuda.empty_cache()
    hf = load_hf_model(str(resolve_builtin("stories260K")))  # (on the CPU)
    llm = LLM("stories260K", device="cuda", block_size=16, max_num_batched_tokens=24,
              gpu_memory_utilization=0.05, async_scheduling=async_scheduling)
    scored = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, prompt_logprobs=4)
    plain = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    prompts = STORIES + _prompts(4, 512, 5)
    outs = llm.generate(prompts, [scored, plain] * 4, use_tqdm=False)
    for out in outs[::2]:
        check_against_hf(out, hf, 4)
    assert all(o.prompt_logprobs is None for o in outs[1::2])
    assert [o.outputs[0].token_ids for o in outs] == _greedy_hf(  # the ids the engine ran
        load_hf_model(str(resolve_builtin("stories260K")), torch.float32, "cuda"),
        [o.prompt_token_ids for o in outs], 16)


def test_async_scheduling_equals_sync_on_gpu(tmp_path):
    """Greedy and seeded requests end the same with and without async scheduling (CUDA graphs
    on), including stops read a step late."""
    make_tiny_hf_model("qwen3", tmp_path / "q3", dtype=torch.float32)
    prompts = _prompts(40, 97, 3)
    params = [SamplingParams(temperature=0, max_tokens=8 + i, stop_token_ids=[5])
              if i % 2 else SamplingParams(temperature=0.9, seed=i, max_tokens=30)
              for i in range(40)]
    res = []
    for a in (False, True):
        llm = LLM(str(tmp_path / "q3"), dtype="float32", device="cuda", max_num_seqs=48,
                  num_blocks=512, async_scheduling=a)
        res.append([o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
        del llm
    assert res[0] == res[1]


def test_triton_attention_reads_an_fp8_cache():
    """bf16 queries over a float8 e4m3 cache: tiles are widened to bf16 in the kernel."""
    import math
    from minipaged.attention.metadata import AttentionMetadata
    from minipaged.attention.torch_ref import paged_attention_reference
    from minipaged.attention.triton_backend import TritonBackend
    g = torch.Generator(device="cuda").manual_seed(0)
    nb, bs, kvh, d, h = 64, 16, 8, 128, 16
    k = torch.randn(nb, bs, kvh, d, device="cuda", generator=g).to(torch.float8_e4m3fn)
    v = torch.randn(nb, bs, kvh, d, device="cuda", generator=g).to(torch.float8_e4m3fn)
    qlens, ctxs = [1, 3, 1, 1], [37, 200, 5, 129]  # decodes and a 3-token chunk
    perm = torch.randperm(nb, device="cuda", generator=g).to(torch.int32)
    tables = perm[:4 * 16].view(4, 16)
    q = torch.randn(sum(qlens), h, d, device="cuda", generator=g).to(torch.bfloat16)
    cu = torch.tensor([0, 1, 4, 5, 6], dtype=torch.int32, device="cuda")
    md = AttentionMetadata(slot_mapping=torch.full((6,), -1, device="cuda"), block_tables=tables,
                           context_lens=torch.tensor(ctxs, dtype=torch.int32, device="cuda"),
                           cu_seqlens_q=cu, query_lens=qlens, context_lens_host=ctxs,
                           max_query_len=3, max_context_len=200, block_size=bs)
    scale = 1 / math.sqrt(d)
    backend = TritonBackend()
    backend.prepare(md)
    out = backend.attend(q, k, v, md, scale)
    ref = paged_attention_reference(q, k, v, md, scale)
    torch.testing.assert_close(out.float(), ref.float(), atol=3e-2, rtol=3e-2)


def test_stories260k_fp8_cache_on_gpu():
    """Fused K/V store into float8, graphs, Triton attention: SOURCE.md's story survives, as on
    the CPU (tests/test_kv_cache_fp8.py)."""
    from tests.helpers import STORIES_EXPECTED
    llm = LLM("stories260K", device="cuda", dtype="float32", kv_cache_dtype="fp8",
              gpu_memory_utilization=0.05)
    out = llm.generate("Once upon a time", SamplingParams(temperature=0, max_tokens=40),
                       use_tqdm=False)[0]
    ids = out.prompt_token_ids + out.outputs[0].token_ids
    assert ids == STORIES_EXPECTED[:len(ids)]


def test_cuda_engine_freezes_the_heap_and_is_still_freed_when_dropped():
    """A CUDA engine freezes the heap at the end of its set-up (`engine.freeze_gc_heap`, so no
    full garbage collection walks torch and the model mid-run); a dropped engine, CUDA graphs
    and all, must then go away by reference counting, with its GPU memory."""
    import gc
    import weakref

    gc.collect()
    torch.cuda.empty_cache()
    frozen = gc.get_freeze_count()
    llm = LLM("stories260K", device="cuda", block_size=16, max_num_seqs=16,
              gpu_memory_utilization=0.05)
    assert llm.engine.model_runner.cuda_graphs.get("decode") is not None
    assert gc.get_freeze_count() > frozen
    llm.generate(["Once upon a time"] * 3, SamplingParams(max_tokens=20, ignore_eos=True),
                 use_tqdm=False)
    refs = [weakref.ref(o) for o in (llm.engine, llm.engine.model, llm.engine.model_runner,
                                     llm.engine.model_runner.cuda_graphs.get("decode"))]
    kv = weakref.ref(llm.engine.kv_cache)
    gc.collect()  # what generate left behind; frozen objects are not collected
    try:
        del llm
        assert [r() is None for r in refs + [kv]] == [True] * (len(refs) + 1)
    finally:
        gc.unfreeze()


# --- fp8 weights (models/quantization/fp8.py) ---------------------------------------------------
@pytest.mark.parametrize("tokens", [1, 7, 64, 300])
def test_scaled_mm_fp8_linear_equals_the_dequantizing_path(tokens):
    """torch._scaled_mm (fp8 tensor cores, row-wise scales) computes the CPU path's numbers: the
    same fp8 operands, the products summed in fp32, both scales applied, bf16 out."""
    from minipaged.models.quantization.fp8 import (Fp8Linear, ScaledMMFp8Linear, fp8_linear,
                                                   scaled_mm_supported)
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 tensor cores need compute capability 8.9+")
    g = torch.Generator().manual_seed(tokens)
    linear = torch.nn.Linear(1024, 768, bias=True)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(768, 1024, generator=g) * 0.02)
        linear.bias.copy_(torch.randn(768, generator=g) * 0.1)
    linear = linear.to(torch.bfloat16).float()  # weights that bf16 holds exactly
    gpu = copy.deepcopy(linear).to("cuda", torch.bfloat16)
    assert scaled_mm_supported(gpu)
    fast = fp8_linear(gpu)
    assert type(fast) is ScaledMMFp8Linear
    x = (torch.randn(tokens, 1024, generator=g) * torch.logspace(-2, 1, tokens)[:, None])
    x = x.to(torch.bfloat16)
    got = fast(x.cuda()).float().cpu()
    cpu = Fp8Linear.from_linear(linear)  # the same weights, quantized on the CPU
    want = cpu(x.float())
    same = fast.weight.cpu().view(torch.uint8) == cpu.weight.view(torch.uint8)
    assert same.float().mean() > 0.999  # the same fp8 weights (fp32 division on both sides)
    torch.testing.assert_close(got, want, rtol=1.6e-2, atol=1e-2 * float(want.abs().max()))
    # a shape _scaled_mm refuses (172 features) falls back to the dequantizing layer, on the GPU
    odd = torch.nn.Linear(172, 64, bias=False).to("cuda", torch.bfloat16)
    assert type(fp8_linear(odd)) is Fp8Linear


def test_triton_per_token_quant_equals_torch_on_gpu():
    """fp8_triton.py's kernel compiled for the GPU: quantize_rowwise's scales and fp8 values."""
    from minipaged.models.quantization.fp8 import quantize_rowwise
    from minipaged.models.quantization.fp8_triton import per_token_quant_fp8
    g = torch.Generator().manual_seed(0)
    for hidden in (64, 1024, 3072, 8192):
        x = torch.randn(300, hidden, generator=g) * torch.logspace(-3, 2, 300)[:, None]
        x[5] = 0
        x[7, :10] *= 1e-4
        x = x.to("cuda", torch.bfloat16)
        want_q, want_s = quantize_rowwise(x)
        got_q, got_s = per_token_quant_fp8(x)
        assert torch.equal(got_s, want_s), hidden
        assert torch.equal(got_q.float(), want_q.float()), hidden


def test_stories260k_fp8_weights_with_cuda_graphs():
    """quantization="fp8" in bf16 on CUDA: _scaled_mm for q/k/v and o (64-wide), the fallback
    for the MLP (172-wide); decode replayed from CUDA graphs gives the eager tokens, and the story
    opens as float32's does (on the CPU fp8 parts from it at output token 16); with an fp8 KV
    cache too."""
    from minipaged.models.quantization.fp8 import Fp8Linear, ScaledMMFp8Linear
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 tensor cores need compute capability 8.9+")
    prompts = ["Once upon a time", "The cat", "Lily and Ben went to the", "One day, a big"]
    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    res = {}
    for eager in (True, False):
        llm = LLM("stories260K", device="cuda", dtype="bfloat16", quantization="fp8",
                  enforce_eager=eager, gpu_memory_utilization=0.05)
        assert (llm.engine.model_runner.cuda_graphs.get("decode") is None) == eager
        layer = llm.engine.model.model.layers[0]
        assert type(layer.self_attn.qkv_proj) is ScaledMMFp8Linear
        assert type(layer.mlp.down_proj) is Fp8Linear
        res[eager] = [o.outputs[0] for o in llm.generate(prompts, sp, use_tqdm=False)]
        del llm
    assert [o.token_ids for o in res[True]] == [o.token_ids for o in res[False]]
    assert res[False][0].text.startswith(", there was a little girl")
    llm = LLM("stories260K", device="cuda", dtype="bfloat16", quantization="fp8",
              kv_cache_dtype="fp8", gpu_memory_utilization=0.05)
    out = llm.generate(prompts[:1], sp, use_tqdm=False)[0].outputs[0]
    assert out.text.startswith(", there was a little girl")


@pytest.mark.parametrize("enforce_eager", [True, False])
def test_lora_adapters_on_gpu_equal_cpu_reference(tmp_path, enforce_eager):
    """stories260K with three random adapters (no peft here: written by save_random_adapter)
    and the base model mixed in one batch: the Triton shrink/expand on CUDA, with CUDA-graph
    decode replays or without, gives the CPU torch reference's tokens (tests/test_lora.py
    proves the CPU path equal to PEFT). max_loras=2 makes the third adapter evict one."""
    import json

    from minipaged import LoRARequest
    from minipaged.lora.random_adapter import save_random_adapter
    from minipaged.models.config import ModelConfig
    cfg = ModelConfig.from_dict(json.load(open(resolve_builtin("stories260K") / "config.json")))
    loras = [LoRARequest(f"a{i}", i + 1, save_random_adapter(
        str(tmp_path / f"a{i}"), cfg, rank=r, lora_alpha=2 * r, seed=i, std=0.3,
        use_rslora=i == 2)) for i, r in enumerate((8, 16, 4))]
    prompts = _prompts(24, 512, 2)
    per_prompt = [None if i % 4 == 3 else loras[i % 4] for i in range(len(prompts))]
    sp = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    outs = {}
    for device in ("cpu", "cuda"):
        llm = LLM("stories260K", device=device, enable_lora=True, max_loras=2, max_lora_rank=16,
                  num_blocks=256, max_num_seqs=32, enforce_eager=enforce_eager)
        if device == "cuda":
            assert (llm.engine.model_runner.cuda_graphs.get("decode") is None) == enforce_eager
            assert type(llm.engine.lora_manager.punica).__name__ == "TritonPunicaWrapper"
        replays = []  # the decode graph set of each replay: "decode" (LoRA kernels), "lora-base"
        if device == "cuda" and not enforce_eager:
            for variant in ("decode", "lora-base"):
                graphs = llm.engine.model_runner.cuda_graphs.get(variant)
                graphs.run = lambda *a, v=variant, run=graphs.run: replays.append(v) or run(*a)
        res = llm.generate(prompts, sp, use_tqdm=False, lora_request=per_prompt)
        outs[device] = [o.outputs[0].token_ids for o in res]
        if device == "cuda" and not enforce_eager:  # the last decode step had adapters
            assert replays[-1] == "decode"
        base = [o.outputs[0].token_ids for o in llm.generate(prompts[:4], sp, use_tqdm=False)]
        if device == "cuda" and not enforce_eager:  # no adapter: the graphs without LoRA kernels
            assert replays[-1] == "lora-base"
        assert base[3] == outs[device][3]  # the base model's row in the mixed batch
        assert all(base[i] != outs[device][i] for i in range(3))  # the adapters change it
        del llm
    assert outs["cuda"] == outs["cpu"]


def test_lora_triton_kernel_bf16_on_gpu():
    """The tensor-core branch in bf16 (what the benchmark runs) against the fp32 reference of
    the same bf16 inputs, with decode-sized and prefill-sized batches and Qwen3-0.6B's widths."""
    from minipaged.lora import punica
    from minipaged.lora.triton_punica import TritonPunicaWrapper
    g = torch.Generator().manual_seed(0)
    for num_tokens, k, n, out in ((256, 1024, 48, 4096), (3000, 3072, 16, 1024)):
        x = torch.randn(num_tokens, k, generator=g).bfloat16()
        a = (torch.randn(4, n, k, generator=g) * 0.05).bfloat16()
        b = (torch.randn(4, out, n, generator=g) * 0.05).bfloat16()
        y = torch.randn(num_tokens, out, generator=g).bfloat16()
        scaling = torch.rand(4, generator=g) + 0.5
        token_lora = torch.randint(-1, 4, (num_tokens,), generator=g)
        want = punica.add_lora(y.float(), x.float(), a.float(), b.float(), scaling, token_lora)
        wrapper = TritonPunicaWrapper(4, 4096, torch.device("cuda"))
        wrapper.update(token_lora.tolist())
        wrapper.scaling.copy_(scaling)
        got = wrapper.add_lora(y.cuda(), x.cuda(), a.cuda(), b.cuda())
        torch.testing.assert_close(got.float().cpu(), want, rtol=2e-2, atol=5e-2)


# --- speculative decoding (minipaged/spec_decode/, lesson 10) -----------------------------
def _repetitive_prompts(n, seed):
    """Half of them say a random phrase twice: prompt lookup finds the second half."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        body = [rng.randrange(3, 512) for _ in range(rng.randint(6, 60))]
        out.append([1] + (body[:len(body) // 2] * 2 if i % 2 else body))
    return out


@pytest.mark.parametrize("k", [1, 4])
def test_spec_decode_ngram_greedy_parity_on_gpu(k):
    """Verify steps replay the verify graphs (k + 1 query tokens, spec_decode/cuda_graphs.py),
    steps without proposals the decode graphs."""
    import gc
    gc.collect()
    torch.cuda.empty_cache()
    hf = load_hf_model(str(resolve_builtin("stories260K")), torch.float32, "cuda")
    prompts = _repetitive_prompts(32, k)
    llm = LLM("stories260K", device="cuda", block_size=16, max_num_seqs=64,
              num_blocks=1024,  # not a share of the GPU: earlier tests' memory may linger
              speculative_config={"method": "ngram", "num_speculative_tokens": k,
                                  "prompt_lookup_max": 3})
    runner = llm.engine.model_runner
    verify_graphs = runner.cuda_graphs.get("verify")
    assert runner.cuda_graphs.get("decode") is not None and verify_graphs.graphs
    assert llm.config.async_scheduling is False  # turned off by speculation
    replays = []
    run = verify_graphs.run
    verify_graphs.run = lambda *a: replays.append(1) or run(*a)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=48, ignore_eos=True),
                        use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == _greedy_hf(hf, prompts, 48)
    assert llm.engine.step_loop.stats.num_accepted_tokens > 0 and replays
    assert llm.engine.block_manager.num_free_blocks == llm.engine.num_blocks


def test_spec_decode_verify_graphs_equal_eager_fp32_qwen3(tmp_path):
    make_tiny_hf_model("qwen3", tmp_path / "q3", dtype=torch.float32)
    rng = random.Random(5)
    prompts = [[1] + [rng.randrange(3, 97) for _ in range(rng.randint(4, 30))] * 2
               for _ in range(24)]
    sp = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    res = []
    for eager in (True, False):
        llm = LLM(str(tmp_path / "q3"), dtype="float32", device="cuda", max_num_seqs=32,
                  enforce_eager=eager, num_blocks=512,
                  speculative_config={"method": "ngram", "num_speculative_tokens": 3})
        assert (llm.engine.model_runner.cuda_graphs.get("verify") is None) == eager
        res.append([o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)])
        del llm
    assert res[0] == res[1]


def test_spec_decode_draft_model_greedy_parity_on_gpu(tmp_path):
    """The target as its own draft (everything accepted) and a random tiny Llama with its
    vocabulary (almost nothing accepted): greedy equals HF either way; small caches that force
    preemption."""
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512,
                      bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    LlamaForCausalLM(cfg).save_pretrained(str(tmp_path / "tiny"))
    hf = load_hf_model(str(resolve_builtin("stories260K")), torch.float32, "cuda")
    prompts = _repetitive_prompts(24, 7)
    expected = _greedy_hf(hf, prompts, 40)
    for draft, full in (("stories260K", True), (str(tmp_path / "tiny"), False)):
        llm = LLM("stories260K", device="cuda", block_size=16, num_blocks=40, max_model_len=256,
                  max_num_batched_tokens=64, max_num_seqs=32,
                  speculative_config={"method": "draft_model", "model": draft,
                                      "num_speculative_tokens": 3})
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=40,
                                                    ignore_eos=True), use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == expected, draft
        stats = llm.engine.step_loop.stats
        assert stats.num_draft_tokens > 0
        assert (stats.num_accepted_tokens == stats.num_draft_tokens) == full
        assert sum(len(r.preempted) for r in llm.trace) > 0
        del llm


def test_spec_decode_seeded_sampling_reproducible_on_gpu():
    prompts = _repetitive_prompts(8, 3)
    params = [SamplingParams(temperature=0.9, top_p=0.95, seed=i, max_tokens=32, ignore_eos=True)
              for i in range(8)]
    runs = []
    for _ in range(2):
        llm = LLM("stories260K", device="cuda", num_blocks=1024, max_num_seqs=32,
                  speculative_config={"method": "ngram", "num_speculative_tokens": 3})
        runs.append([o.outputs[0].token_ids
                     for o in llm.generate(prompts, params, use_tqdm=False)])
        del llm
    assert runs[0] == runs[1]


@pytest.mark.parametrize("enforce_eager", [True, False])
@pytest.mark.parametrize("n", [2, 4])
def test_tensor_parallel_fp32_parity_with_hf_on_gpus(n, enforce_eager):
    """stories260K split over n GPUs (NCCL, every rank capturing its graphs) gives HF's greedy
    tokens, as one GPU does."""
    if torch.cuda.device_count() < n:
        pytest.skip(f"needs {n} GPUs")
    import gc
    gc.collect()
    torch.cuda.empty_cache()
    hf = load_hf_model(str(resolve_builtin("stories260K")), torch.float32, "cuda")
    prompts = _prompts(32, 512, 3)
    llm = LLM("stories260K", device="cuda", block_size=16, max_num_seqs=64,
              enforce_eager=enforce_eager, gpu_memory_utilization=0.05, tensor_parallel_size=n)
    assert llm.engine.config.use_cuda_graphs != enforce_eager
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=48, ignore_eos=True),
                        use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == _greedy_hf(hf, prompts, 48)


def test_pinned_staging_while_the_gpu_is_busy():
    """worker/staging.py on a GPU: each step's inputs go up through a reused pinned buffer while
    a long kernel keeps the GPU busy; a buffer comes around again (3 slots, 8 steps) only once
    its copy is done, so no step sees another's values."""
    from minipaged.worker.staging import StepStaging
    staging = StepStaging(torch.device("cuda"), num_slots=3)
    busy = torch.randn(4096, 4096, device="cuda")
    results = []
    for step in range(8):
        busy = busy @ busy / 64  # queued work the copies must not wait for nor overtake
        staged = staging.stage([(torch.int64, 1000 + step), (torch.int32, 7)])
        staged.host[0][:] = step
        staged.host[1][:] = -step
        ids, small = staged.to_device()
        results.append((ids * 2 + small[:1].long(), step))  # = step, computed after `busy`
    torch.cuda.synchronize()
    for out, step in results:
        assert out.shape == (1000 + step,) and torch.all(out == step).item()


def test_kernel_sampler_keeps_one_launch_variant_across_seeds():
    """`CompiledLaunch` keys pick_kernel's variants without the per-step seed (Triton does not
    specialise on it): a new seed every step must not compile, nor keep, a new variant."""
    from minipaged.sampling import kernels
    logits = torch.randn(3, 1000, device="cuda", dtype=torch.bfloat16)
    inv_t = torch.full((3,), 1 / 0.7, device="cuda")
    for seed in (5, 16, 1, 2**31 - 2, 12345):
        kernels.gumbel_sample(logits, inv_t, seed)
    assert len([k for k in kernels._pick_launch.variants if 1000 in k]) == 1
