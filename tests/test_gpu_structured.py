"""GPU-only checks of grammar masks (lesson 12; skipped without CUDA, run on the GPU machine):
structured outputs with Qwen3's 151,936-token vocabulary, the greedy rows' masked-argmax kernel as
compiled for the GPU (and launched through `kernel_launch.CompiledLaunch`), and async scheduling's
deferred constrained steps against synchronous ones."""
import pytest
import torch

from minipaged import LLM, SamplingParams
from tests.test_gpu import _prompts

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_structured_outputs_on_gpu_with_a_qwen3_sized_vocabulary(tmp_path):
    """Grammar masks on CUDA (the bitmask copied to the GPU and applied inside the sampling
    kernels, async scheduling being CUDA's default; they also flag the rows whose grammar ended)
    over Qwen3's 151,936 ids: dummy Qwen3-0.6B with the benchmark's synthetic byte-level
    tokenizer. Constrained rows end ("stop") in JSON of the schema; the unconstrained rows of the
    same batch sample the first token they sample with no constraint anywhere (same shapes)."""
    import json
    import sys
    from pathlib import Path
    pytest.importorskip("xgrammar")
    from minipaged.structured_output import StructuredOutputsParams
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks" / "lib"))
    from synthetic_tokenizer import write_synthetic_tokenizer

    import gc
    gc.collect()
    torch.cuda.empty_cache()
    folder = write_synthetic_tokenizer(tmp_path / "vocab")
    llm = LLM("dummy:qwen3-0.6b", tokenizer=str(folder), device="cuda", dtype="bfloat16",
              max_model_len=512, gpu_memory_utilization=0.2,
              enable_prefix_caching=False)  # the second run prefills as the first
    schema = {"type": "object", "additionalProperties": False, "required": ["ok", "n", "pet"],
              "properties": {"ok": {"type": "boolean"},
                             "n": {"type": "integer", "minimum": 1, "maximum": 9},
                             "pet": {"enum": ["cat", "dog"]}}}
    so = StructuredOutputsParams(json=schema, disable_any_whitespace=True)
    prompts = _prompts(16, 151936, 5)
    free = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    params = [SamplingParams(temperature=0, max_tokens=64,
                             structured_outputs=so if i % 2 == 0 else None) for i in range(16)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    for i, (o, f) in enumerate(zip(outs, free)):
        c = o.outputs[0]
        if i % 2:
            assert c.token_ids[0] == f.outputs[0].token_ids[0]
            continue
        assert c.finish_reason == "stop", c.text
        doc = json.loads(c.text)
        assert sorted(doc) == ["n", "ok", "pet"] and isinstance(doc["ok"], bool)
        assert doc["n"] in range(1, 10) and doc["pet"] in ("cat", "dog")


@pytest.mark.parametrize("vocab", [512, 32000, 50257, 151936])
def test_masked_argmax_on_gpu_equals_torch(vocab):
    """The greedy rows' grammar-mask kernel as compiled for the GPU (its block and warps differ
    from the CPU interpreter's): the first maximum among each row's allowed tokens, and the flag
    of the masked rows that allow stop tokens only, as torch computes them."""
    from minipaged.sampling.kernels import masked_argmax
    from minipaged.sampling.params import TokenMask
    from minipaged.structured_output.manager import ended_rows
    g = torch.Generator().manual_seed(vocab)
    rows, words = 64, (vocab + 31) // 32
    stop = vocab - 1 if vocab % 32 == 0 else vocab // 2 + 3  # (a last word only partly used)
    allowed = torch.rand(rows, vocab, generator=g) < 0.3
    allowed[1] = False
    allowed[1, stop] = True  # ended: the stop token only
    allowed[2] = False  # nothing allowed
    allowed[4] = False
    allowed[4, vocab - 1] = True  # the last token only
    logits = torch.randn(rows, vocab, generator=g).to(torch.bfloat16)
    logits[3, :] = 1.0  # ties: the first allowed one wins
    bits = torch.zeros(rows, words * 32, dtype=torch.int64)
    bits[:, :vocab] = allowed.long()
    weights = 1 << torch.arange(32, dtype=torch.int64)
    bitmask = (bits.view(rows, words, 32) * weights).sum(-1).to(torch.int64)
    bitmask = torch.where(bitmask >= 2**31, bitmask - 2**32, bitmask).to(torch.int32)
    masked = torch.ones(rows, dtype=torch.int32)
    masked[5] = 0  # not constrained
    keep = torch.full((words,), -1, dtype=torch.int64)
    keep[stop // 32] &= ~(1 << (stop % 32))
    keep = keep.to(torch.int32)  # (the low 32 bits: as manager.keep_words makes them)
    mask = TokenMask(bitmask.cuda(), masked.cuda(), keep.cuda())
    forbid = ~allowed & masked.bool()[:, None]
    expect = logits.float().masked_fill(forbid, float("-inf")).argmax(-1)
    ended = ended_rows(TokenMask(bitmask, masked, keep))
    dev_logits = logits.cuda()
    # the same logits 2 bytes into a buffer: not 16-byte aligned, the same strides; and 2 bytes
    # into each row of a wider one: another row stride too
    flat = torch.zeros(rows * vocab + 1, dtype=torch.bfloat16, device="cuda")
    flat[1:] = dev_logits.flatten()
    shifted = flat[1:].view(rows, vocab)
    wide = torch.zeros(rows, vocab + 1, dtype=torch.bfloat16, device="cuda")
    wide[:, 1:] = dev_logits
    # Each twice: the second launch of a variant goes through its compiled launcher
    # (kernel_launch.CompiledLaunch); fewer rows are another grid of the same variant.
    for x, n in [(dev_logits, rows), (dev_logits, rows), (shifted, rows), (shifted, rows),
                 (wide[:, 1:], rows), (wide[:, 1:], rows), (dev_logits[:17], 17)]:
        out = masked_argmax(x, mask).cpu()
        ok = [r for r in range(n) if r != 2]  # (row 2: any token, flagged)
        assert out[0, ok].tolist() == expect[ok].tolist()
        assert out[1].tolist() == ended[:n].tolist()
        assert out[1, 1] == 1 and out[1, 2] == 1 and out[1, 5] == 0


@pytest.mark.parametrize("seeded", [False, True])
def test_structured_outputs_async_scheduling_equals_sync_on_gpu(tmp_path, seeded):
    """Constrained steps stay asynchronous on CUDA (the previous tokens read before the masks
    are filled, the bitmask copied from pinned memory while the forward runs): the same tokens
    as synchronous steps. Every row is held to an array that cannot end before max_tokens, so
    both runs step the same batches. Seeded rows take the torch sampler (the masks applied to
    the logits, from the bitmask `token_mask` copied) instead of the masked kernels."""
    import gc
    import sys
    from pathlib import Path
    pytest.importorskip("xgrammar")
    from minipaged.structured_output import StructuredOutputsParams
    bench = Path(__file__).resolve().parent.parent / "benchmarks"
    sys.path[:0] = [str(bench), str(bench / "lib")]
    from structured_outputs import SCHEMA
    from synthetic_tokenizer import write_synthetic_tokenizer

    folder = write_synthetic_tokenizer(tmp_path / "vocab")
    prompts = _prompts(32, 151936, 6)
    so = StructuredOutputsParams(json=SCHEMA)
    sps = [SamplingParams(temperature=0.8 if seeded else 0, seed=i if seeded else None,
                          max_tokens=48, ignore_eos=True, structured_outputs=so)
           for i in range(len(prompts))]
    res, in_flight = [], 0
    for flag in (False, True):
        gc.collect()
        torch.cuda.empty_cache()
        llm = LLM("dummy:qwen3-0.6b", tokenizer=str(folder), device="cuda", dtype="bfloat16",
                  max_model_len=512, gpu_memory_utilization=0.2, enable_prefix_caching=False,
                  async_scheduling=flag)
        eng = llm.engine
        for i, p in enumerate(prompts):
            eng.add_request(str(i), p, sps[i])
        outs = []
        while eng.has_unfinished_requests():
            outs += eng.step()
            in_flight += flag and eng.step_loop.pending is not None
        done = {o.request_id: o.outputs[0] for o in outs if o.finished}
        res.append([done[str(i)].token_ids for i in range(len(prompts))])
        assert all(done[str(i)].text.startswith("[") for i in range(len(prompts)))
        del llm, eng
    assert in_flight > 20
    assert res[0] == res[1]
