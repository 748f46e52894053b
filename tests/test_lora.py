"""Multi-LoRA serving (minipaged/lora/): PEFT adapters, mixed in one batch, against PEFT itself.

The adapters are made here with `peft` on stories260K: LoraConfig(init_lora_weights=False) gives
random A *and* B (a fresh PEFT adapter has B = 0, which would change nothing), saved with
save_pretrained. The reference is the PEFT model's `generate(do_sample=False)`, token for token.
"""
from __future__ import annotations

import copy
import json
import os
import random

import pytest
import torch

from minipaged import LLM, LoRARequest, RequestError, SamplingParams
from minipaged.engine.sequence import SequenceStatus
from minipaged.lessons.baseline import load_hf_model
from minipaged.lora import punica
from minipaged.models.loader import resolve_builtin
from tests.helpers import IGNORE_INTERPRETER_WARNINGS, hf_greedy

peft = pytest.importorskip("peft")

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# name -> (seed, LoraConfig fields)
ADAPTERS = {
    "all8": (1, dict(r=8, lora_alpha=16, target_modules=ALL)),
    "attn4": (2, dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])),
    "mlp8": (3, dict(r=8, lora_alpha=32, target_modules=["o_proj", "gate_proj", "up_proj",
                                                         "down_proj"])),
    "rs16": (4, dict(r=16, lora_alpha=8, use_rslora=True, target_modules=ALL)),
}
N_NEW = 16


def greedy(n=N_NEW):
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def random_prompts(n, seed, lo=3, hi=30):
    rng = random.Random(seed)
    return [[1] + [rng.randrange(3, 512) for _ in range(rng.randint(lo, hi) - 1)]
            for _ in range(n)]


PROMPTS = random_prompts(3, seed=0)


@pytest.fixture(scope="module")
def stories_hf():
    return load_hf_model(str(resolve_builtin("stories260K")))


@pytest.fixture(scope="module")
def adapters(stories_hf, tmp_path_factory):
    """name -> (LoRARequest, PEFT's greedy tokens for PROMPTS)."""
    root = tmp_path_factory.mktemp("adapters")
    out = {}
    for i, (name, (seed, kw)) in enumerate(ADAPTERS.items()):
        torch.manual_seed(seed)
        cfg = peft.LoraConfig(init_lora_weights=False, lora_dropout=0.0, **kw)
        model = peft.get_peft_model(copy.deepcopy(stories_hf), cfg).eval()
        with torch.no_grad():  # larger B than PEFT's random init: the adapter must matter
            for n, p in model.named_parameters():
                if "lora_B" in n:
                    p.mul_(4.0)
        path = root / name
        model.save_pretrained(str(path))
        out[name] = (LoRARequest(name, i + 1, str(path)), hf_greedy(model, PROMPTS, N_NEW))
    return out


@pytest.fixture(scope="module")
def base_tokens(stories_hf):
    return hf_greedy(stories_hf, PROMPTS, N_NEW)


def lora_llm(**kw):
    args = dict(enable_lora=True, max_loras=4, max_lora_rank=16, num_blocks=128,
                block_size=8, device="cpu") | kw
    return LLM("stories260K", **args)


def tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


# --- parity with PEFT --------------------------------------------------------------------------
def test_each_adapter_equals_peft(adapters, base_tokens):
    llm = lora_llm()
    for name, (req, expected) in adapters.items():
        got = tokens(llm.generate(PROMPTS, greedy(), use_tqdm=False, lora_request=req))
        assert got == expected, name
        assert got != base_tokens, f"{name} changes nothing: the test could not fail"
    assert tokens(llm.generate(PROMPTS, greedy(), use_tqdm=False)) == base_tokens


def test_three_adapters_and_base_in_one_batch(adapters, base_tokens):
    llm = lora_llm()
    names = ["all8", "attn4", "mlp8", None]
    prompts, loras, expected = [], [], []
    for j in range(len(PROMPTS)):
        for name in names:  # interleaved: every step mixes all four
            prompts.append(PROMPTS[j])
            loras.append(adapters[name][0] if name else None)
            expected.append(adapters[name][1][j] if name else base_tokens[j])
    steps = []
    manager = llm.engine.lora_manager
    prepare = manager.prepare_step
    manager.prepare_step = lambda entries: (steps.append({e.seq.lora_int_id for e in entries}),
                                            prepare(entries))
    assert tokens(llm.generate(prompts, greedy(), use_tqdm=False, lora_request=loras)) == expected
    assert {0, 1, 2, 3} in steps  # one step held the base model and all three adapters
    assert manager.num_loads == 3 and manager.num_evictions == 0


def test_more_adapters_than_slots_evicts_and_stays_exact(adapters):
    llm = lora_llm(max_loras=2)
    names = ["all8", "attn4", "mlp8"]
    prompts = [p for p in PROMPTS for _ in names]
    loras = [adapters[n][0] for _ in PROMPTS for n in names]
    expected = [adapters[n][1][j] for j in range(len(PROMPTS)) for n in names]
    steps = []
    manager = llm.engine.lora_manager
    prepare = manager.prepare_step
    manager.prepare_step = lambda entries: (steps.append({e.seq.lora_int_id for e in entries}),
                                            prepare(entries))
    assert tokens(llm.generate(prompts, greedy(), use_tqdm=False, lora_request=loras)) == expected
    assert max(len(s - {0}) for s in steps) == 2  # never more adapters in a step than slots
    # two loads into free slots, then every further load evicted the least recently used one
    assert manager.num_evictions >= 1 and manager.num_loads == 2 + manager.num_evictions


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_chunked_prefill_and_samples_stay_exact(adapters, base_tokens, mode):
    """A cache too small for the batch (preemption), 16-token steps (chunked prefill), n=2
    greedy samples (forks keep their adapter) and max_loras=2 for three adapters + base."""
    llm = lora_llm(max_loras=2, num_blocks=14, max_model_len=64, max_num_batched_tokens=16,
                   preemption_mode=mode)
    names = ["all8", "attn4", None, "mlp8"]
    prompts = [PROMPTS[j] for j in range(len(PROMPTS)) for _ in names]
    loras = [adapters[n][0] if n else None for _ in PROMPTS for n in names]
    expected = [adapters[n][1][j] if n else base_tokens[j]
                for j in range(len(PROMPTS)) for n in names]
    params = SamplingParams(temperature=0.0, max_tokens=N_NEW, ignore_eos=True, n=2)
    outs = llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
    assert [[c.token_ids for c in o.outputs] for o in outs] == [[e, e] for e in expected]
    assert llm.engine.scheduler.num_preemptions > 0


def test_scheduler_keeps_extra_adapters_waiting(adapters):
    """The guard: without the scheduler's slot count, a step would hold 3 adapters in 2 slots."""
    llm = lora_llm(max_loras=2)
    llm.engine.scheduler.max_loras = 99  # what the scheduler would do without its guard
    loras = [adapters[n][0] for n in ("all8", "attn4", "mlp8")]
    with pytest.raises(RuntimeError, match="3 adapters scheduled in one step, but max_loras=2"):
        llm.generate([PROMPTS[0]] * 3, greedy(), use_tqdm=False, lora_request=loras)


def test_rslora_scaling(adapters):
    req, expected = adapters["rs16"]
    llm = lora_llm()
    assert tokens(llm.generate(PROMPTS, greedy(), use_tqdm=False, lora_request=req)) == expected
    adapter = llm.engine.lora_manager.adapters[req.lora_int_id]
    assert adapter.rank == 16 and adapter.scaling == pytest.approx(8 / 16 ** 0.5)  # not 8 / 16


# --- the prefix cache ---------------------------------------------------------------------------
def test_prefix_cache_never_shares_blocks_across_adapters(adapters, stories_hf):
    prompt = random_prompts(1, seed=5, lo=40, hi=40)  # 5 blocks of 8
    llm = lora_llm()
    a, b = adapters["all8"][0], adapters["mlp8"][0]
    first = llm.generate(prompt, greedy(), use_tqdm=False, lora_request=a)[0]
    other = llm.generate(prompt, greedy(), use_tqdm=False, lora_request=b)[0]
    base = llm.generate(prompt, greedy(), use_tqdm=False)[0]
    again = llm.generate(prompt, greedy(), use_tqdm=False, lora_request=a)[0]
    assert first.num_cached_tokens == 0
    assert other.num_cached_tokens == 0 and base.num_cached_tokens == 0  # no hit across adapters
    assert again.num_cached_tokens == 32  # the same adapter does hit (4 full blocks)
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    assert first.outputs[0].token_ids != other.outputs[0].token_ids
    assert base.outputs[0].token_ids == hf_greedy(stories_hf, prompt, N_NEW)[0]


# --- bad input -----------------------------------------------------------------------------------
def test_lora_request_fields():
    with pytest.raises(ValueError, match="lora_int_id must be an integer >= 1"):
        LoRARequest("a", 0, "/x")
    with pytest.raises(ValueError, match="lora_name must be a non-empty string"):
        LoRARequest("", 1, "/x")


def test_config_errors():
    with pytest.raises(ValueError, match="max_loras"):
        LLM("stories260K", enable_lora=True, max_loras=0)
    with pytest.raises(ValueError, match="max_lora_rank"):
        LLM("stories260K", enable_lora=True, max_lora_rank=0)
    with pytest.raises(ValueError, match="enable_lora is not supported with tensor_parallel"):
        LLM("stories260K", enable_lora=True, tensor_parallel_size=2)


def _copy_adapter(src, dst, config=None, tensors=None):
    from safetensors.torch import load_file, save_file
    os.makedirs(dst)
    cfg = json.load(open(os.path.join(src, "adapter_config.json")))
    json.dump(cfg | (config or {}), open(os.path.join(dst, "adapter_config.json"), "w"))
    weights = load_file(os.path.join(src, "adapter_model.safetensors"))
    save_file(tensors(weights) if tensors else weights,
              os.path.join(dst, "adapter_model.safetensors"))


def test_adapter_errors(adapters, tmp_path):
    src = adapters["all8"][0].lora_path
    llm = lora_llm(max_lora_rank=8)

    def fails(path, match, lora_id=9):
        with pytest.raises(RequestError, match=match):
            llm.generate(PROMPTS[:1], greedy(), use_tqdm=False,
                         lora_request=LoRARequest("bad", lora_id, str(path)))

    fails(adapters["rs16"][0].lora_path, r"rank r=16 is larger than max_lora_rank=8")
    fails(tmp_path / "nowhere", "lora_path is not a folder")
    (tmp_path / "empty").mkdir()
    fails(tmp_path / "empty", "adapter_config.json is missing")
    _copy_adapter(src, tmp_path / "embed", {"target_modules": ["q_proj", "embed_tokens"]})
    fails(tmp_path / "embed", r"target_modules \['embed_tokens'\] cannot be adapted")
    _copy_adapter(src, tmp_path / "dora", {"use_dora": True})
    fails(tmp_path / "dora", "use_dora=True is not supported")

    def narrow(w):  # as if trained on a model with a narrower MLP
        key = next(k for k in w if "down_proj.lora_A" in k)
        return w | {key: w[key][:, :100].contiguous()}

    _copy_adapter(src, tmp_path / "shape", tensors=narrow)
    fails(tmp_path / "shape", r"down_proj.lora_A.weight has shape \(8, 100\), but r=8 and the "
                              r"model's down_proj \(172 -> 64\) need \(8, 172\)")

    def layer9(w):
        return {k.replace("layers.0.", "layers.9."): v for k, v in w.items()}

    _copy_adapter(src, tmp_path / "deep", tensors=layer9)
    fails(tmp_path / "deep", "is for layer 9, but the model has 5 layers")
    _copy_adapter(src, tmp_path / "nofile")
    os.remove(tmp_path / "nofile" / "adapter_model.safetensors")
    fails(tmp_path / "nofile", "adapter_model.safetensors is missing")
    llm.generate(PROMPTS[:1], greedy(), use_tqdm=False, lora_request=adapters["all8"][0])
    fails(adapters["attn4"][0].lora_path, "lora_int_id=1 is already adapter 'all8'", lora_id=1)
    # nothing was queued, and the engine still serves
    assert not llm.engine.has_unfinished_requests()
    assert len(llm.generate(PROMPTS[:1], greedy(), use_tqdm=False)[0].outputs[0].token_ids) == 16


def test_chat_takes_a_lora_request(adapters):
    llm = lora_llm()
    req = adapters["all8"][0]
    template = "{{ bos_token }}{% for m in messages %} {{ m['content'] }}{% endfor %}"
    ids = llm.get_tokenizer()("Once upon a time").input_ids  # what the template renders
    messages = [{"role": "user", "content": "Once upon a time"}]
    chat = llm.chat(messages, greedy(), use_tqdm=False, chat_template=template, lora_request=req)
    plain = llm.generate([{"prompt_token_ids": ids}], greedy(), use_tqdm=False, lora_request=req)
    base = llm.chat(messages, greedy(), use_tqdm=False, chat_template=template)
    assert chat[0].prompt_token_ids == ids
    assert chat[0].outputs[0].token_ids == plain[0].outputs[0].token_ids
    assert chat[0].outputs[0].token_ids != base[0].outputs[0].token_ids


def test_lora_request_needs_enable_lora(adapters):
    llm = LLM("stories260K", num_blocks=32, device="cpu")
    with pytest.raises(RequestError, match="built without adapters: pass enable_lora=True"):
        llm.generate(PROMPTS[:1], greedy(), use_tqdm=False, lora_request=adapters["all8"][0])
    with pytest.raises(ValueError, match="a list of one per prompt"):
        llm.generate(PROMPTS[:2], greedy(), use_tqdm=False, lora_request=[None])


# --- the kernels ---------------------------------------------------------------------------------
def _random_case(num_tokens, max_loras, n, k, out, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, k, generator=g)
    a = torch.randn(max_loras, n, k, generator=g)
    b = torch.randn(max_loras, out, n, generator=g)
    scaling = torch.rand(max_loras, generator=g) + 0.5
    token_lora = torch.randint(-1, max_loras, (num_tokens,), generator=g)
    return x, a, b, scaling, token_lora


def test_reference_equals_one_matmul_per_token():
    x, a, b, scaling, token_lora = _random_case(9, 3, 12, 20, 7, seed=0)
    y = torch.randn(9, 7, dtype=torch.float64)
    x, a, b = x.double(), a.double(), b.double()
    got = punica.add_lora(y.clone(), x, a, b, scaling.double(), token_lora)
    for i, s in enumerate(token_lora.tolist()):
        want = y[i] if s < 0 else y[i] + (x[i] @ a[s].T @ b[s].T) * scaling[s].double()
        torch.testing.assert_close(got[i], want)


@IGNORE_INTERPRETER_WARNINGS
@pytest.mark.parametrize("num_tokens,max_loras,n,k,out", [
    (1, 1, 16, 16, 16), (7, 4, 48, 64, 160), (37, 3, 24, 100, 72), (70, 2, 32, 40, 300),
    (40, 3, 16, 1100, 24)])  # the last splits its reduction over programs (in >= 512)
def test_triton_kernel_equals_reference(num_tokens, max_loras, n, k, out):
    pytest.importorskip("triton")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("no GPU and TRITON_INTERPRET is not set")
    from minipaged.lora.punica import PunicaWrapper
    from minipaged.lora.triton_punica import TritonPunicaWrapper
    x, a, b, scaling, token_lora = _random_case(num_tokens, max_loras, n, k, out, seed=num_tokens)
    y = torch.randn(num_tokens, out)
    want = punica.add_lora(y.clone(), x, a, b, scaling, token_lora)
    dev = torch.device(device)
    wrapper = TritonPunicaWrapper(max_loras, 512, dev)
    wrapper.update(token_lora.tolist())
    wrapper.scaling.copy_(scaling)
    assert isinstance(wrapper, PunicaWrapper)
    got = wrapper.add_lora(y.clone().to(dev), x.to(dev), a.to(dev), b.to(dev))
    torch.testing.assert_close(got.cpu(), want, rtol=1e-4, atol=1e-4)


# --- through the server --------------------------------------------------------------------------
def test_server_serves_adapters_by_model_name(adapters, base_tokens):
    httpx = pytest.importorskip("httpx")
    from tests.test_server import ServerThread
    a, b = adapters["all8"][0], adapters["attn4"][0]
    server = ServerThread("stories260K", "--num-blocks", "128", "--device", "cpu",
                          "--enable-lora", "--max-loras", "2", "--max-lora-rank", "8",
                          "--uvicorn-log-level", "warning",
                          "--lora-modules", f"ad1={a.lora_path}",
                          json.dumps({"name": "ad2", "path": b.lora_path}),
                          f"big={adapters['rs16'][0].lora_path}")
    try:
        from minipaged.cli.serve import banner, parse_args
        assert "LoRA adapters (request `model`): ad1, ad2, big; 2 on the device at once, " \
               "rank <= 8, 2 kept in CPU memory" in banner(parse_args(["stories260K"]),
                                                             server.app, port=1)
        models = httpx.get(server.url + "/v1/models").json()["data"]
        assert [(m["id"], m["parent"], m["root"]) for m in models][1:3] == [
            ("ad1", "stories260K", a.lora_path), ("ad2", "stories260K", b.lora_path)]
        assert models[0]["id"] == "stories260K" and models[0]["parent"] is None

        def complete(model, prompt):
            r = httpx.post(server.url + "/v1/completions", timeout=60, json=dict(
                model=model, prompt=prompt, max_tokens=N_NEW, temperature=0, ignore_eos=True,
                logprobs=0))
            return r

        tok = server.app.state.llm.tokenizer
        for model, expected in (("ad1", adapters["all8"][1]), ("ad2", adapters["attn4"][1]),
                                ("stories260K", base_tokens)):
            r = complete(model, PROMPTS[1])
            assert r.status_code == 200, r.text
            choice = r.json()["choices"][0]
            assert choice["text"] == tok.decode(expected[1]), model
        r = complete("ad3", PROMPTS[0])
        assert r.status_code == 404
        assert "ad3" in r.text and "stories260K, ad1, ad2, big" in r.text
        r = complete("big", PROMPTS[0])  # read by the engine core at its first request
        assert r.status_code == 400 and "rank r=16 is larger than max_lora_rank=8" in r.text
        server.wait_idle()
    finally:
        server.stop()


def test_serve_flag_errors(adapters, tmp_path):
    from minipaged.cli.errors import CLIError
    from minipaged.cli.serve import build_app_from_args, parse_args
    path = adapters["all8"][0].lora_path
    with pytest.raises(CLIError, match="--lora-modules needs --enable-lora"):
        build_app_from_args(parse_args(["stories260K", "--lora-modules", f"x={path}"]))
    with pytest.raises(CLIError, match="adapter_config.json is missing"):
        build_app_from_args(parse_args(["stories260K", "--enable-lora", "--lora-modules",
                                        f"x={tmp_path}"]))
    with pytest.raises(CLIError, match="the name 'stories260K' is used twice"):
        build_app_from_args(parse_args(["stories260K", "--enable-lora", "--lora-modules",
                                        f"stories260K={path}"]))
    with pytest.raises(CLIError, match="'no-equals-sign': expected name=path"):
        parse_args(["stories260K", "--lora-modules", "no-equals-sign"])


def test_random_adapter_files_load_in_peft_and_agree(stories_hf, tmp_path):
    """save_random_adapter (benchmarks, GPU tests) writes what PEFT reads, with the same result."""
    from minipaged.lora.random_adapter import save_random_adapter
    from minipaged.models.config import ModelConfig
    cfg = ModelConfig.from_dict(json.load(open(resolve_builtin("stories260K") / "config.json")))
    path = save_random_adapter(str(tmp_path / "r"), cfg, rank=8, lora_alpha=16, seed=3, std=0.3,
                               target_modules=("q_proj", "v_proj", "down_proj"))
    model = peft.PeftModel.from_pretrained(copy.deepcopy(stories_hf), path).eval()
    expected = hf_greedy(model, PROMPTS, N_NEW)
    got = tokens(lora_llm().generate(PROMPTS, greedy(), use_tqdm=False,
                                     lora_request=LoRARequest("r", 1, path)))
    assert got == expected and got != hf_greedy(stories_hf, PROMPTS, N_NEW)


def test_punica_wrapper_tiles_cover_each_adapter_token_once():
    token_lora = [2, -1, 0, 2, 2, 0, -1] + [1] * 37
    w = punica.PunicaWrapper(3, 64, torch.device("cpu"))
    w.update(token_lora)
    order = w.sorted_token_ids[:len(token_lora)].tolist()
    seen = []
    for slot, start, length in zip(w.tile_slot.tolist(), w.tile_start.tolist(),
                                   w.tile_len.tolist()):
        if slot < 0:
            continue
        assert 1 <= length <= punica.TILE_TOKENS
        rows = order[start:start + length]
        assert all(token_lora[r] == slot for r in rows)
        seen += rows
    assert sorted(seen) == [i for i, s in enumerate(token_lora) if s >= 0]
    assert w.token_lora[:len(token_lora)].tolist() == token_lora
    assert set(w.token_lora[len(token_lora):].tolist()) == {-1}
    assert sum(1 for s in w.tile_slot.tolist() if s >= 0) == 1 + 3 + 1  # 37 ones: 3 tiles


def test_lesson_helpers(tmp_path):
    import matplotlib
    matplotlib.use("Agg")
    from minipaged.lessons import lora as lesson
    from minipaged.models.config import ModelConfig
    cfg = ModelConfig.from_dict(json.load(open(resolve_builtin("stories260K") / "config.json")))
    table = lesson.lora_parameter_table(cfg, rank=8)
    assert [r["module"] for r in table][:2] == ["q_proj", "k_proj"]
    assert table[-1] == {"module": "down_proj", "in": 172, "out": 64, "base_params": 172 * 64,
                         "lora_params": 8 * (172 + 64), "share": round(8 * 236 / (172 * 64), 4)}
    lesson.draw_lora_layer(64, 172, 8).savefig(tmp_path / "a.png")
    lesson.draw_mixed_batch([0, 1, -1, 2, 0, 1] * 4).savefig(tmp_path / "b.png")
    rows = lesson.measure_adapter_batch_cost(num_tokens=32, d_in=64, d_out=64, rank=8,
                                             adapter_counts=(1, 4), repeats=1)
    assert [r["adapters"] for r in rows] == [1, 4]
    assert all(r[k] > 0 for r in rows for k in r if k.endswith("per_token"))


@IGNORE_INTERPRETER_WARNINGS
def test_triton_kernel_half_precision_path():
    """fp16 inputs take the tensor-core branch (bf16's on a GPU; the interpreter mishandles bf16
    arithmetic, fp16 it runs): equal to the reference in fp32 of the same rounded inputs."""
    pytest.importorskip("triton")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("no GPU and TRITON_INTERPRET is not set")
    from minipaged.lora.triton_punica import TritonPunicaWrapper
    x, a, b, scaling, token_lora = _random_case(40, 3, 48, 1100, 96, seed=1)
    a, b, y = a * 0.1, b * 0.1, torch.randn(40, 96)
    half = [t.half() for t in (y, x, a, b)]
    want = punica.add_lora(*(t.float() for t in half[:2]), *(t.float() for t in half[2:]),
                           scaling, token_lora)
    dev = torch.device(device)
    wrapper = TritonPunicaWrapper(3, 64, dev)
    wrapper.update(token_lora.tolist())
    wrapper.scaling.copy_(scaling)
    got = wrapper.add_lora(*(t.to(dev) for t in half))
    assert got.dtype == torch.float16
    torch.testing.assert_close(got.float().cpu(), want, rtol=2e-3, atol=2e-2)


@IGNORE_INTERPRETER_WARNINGS
def test_engine_with_triton_kernels_equals_reference(adapters):
    """The engine with the CUDA variant's Triton shrink/expand (here under the interpreter):
    the same tokens as the torch reference path, two adapters and the base in one batch."""
    pytest.importorskip("triton")
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("no GPU and TRITON_INTERPRET is not set")
    from minipaged.lora.triton_punica import TritonPunicaWrapper
    prompts = [p[:6] for p in PROMPTS[:2]] * 2
    loras = [adapters["all8"][0], adapters["rs16"][0], None, adapters["all8"][0]]
    llm = lora_llm()
    reference = tokens(llm.generate(prompts, greedy(3), use_tqdm=False, lora_request=loras))
    llm.engine.lora_manager.punica.__class__ = TritonPunicaWrapper  # every layer shares it
    got = tokens(llm.generate(prompts, greedy(3), use_tqdm=False, lora_request=loras))
    assert got == reference
    assert reference[0] != reference[2]  # the same prompt with all8 and with the base model


# --- the scheduler's slot count ------------------------------------------------------------------
def _lora_seq(prompt, lora_id, name):
    from minipaged.engine.sequence import Sequence
    seq = Sequence(request_id=name, prompt_token_ids=list(prompt),
                   sampling_params=SamplingParams(max_tokens=4))
    seq.lora_request = LoRARequest(f"l{lora_id}", lora_id, "/x") if lora_id else None
    return seq


def test_scheduler_admits_behind_a_waiting_adapter_and_keeps_swapped_ones_out():
    from minipaged.engine.build import build_block_manager, build_scheduler
    bm = build_block_manager(64, 4, enable_prefix_caching=False, enable_lora=True,
                             num_cpu_blocks=64, preemption_mode="swap")
    sched = build_scheduler(bm, max_num_seqs=8, max_num_batched_tokens=64, max_loras=1,
                            preemption_mode="swap")
    a, b, c, d = (_lora_seq([1, 2, 3], lora, n) for lora, n in ((1, "a"), (2, "b"), (0, "c"),
                                                                 (1, "d")))
    for s in (a, b, c, d):
        sched.add(s)
    out = sched.schedule()
    # b's adapter would be a second one in one slot: it waits; c (base) and d (adapter 1) go
    assert [s.seq.request_id for s in out.scheduled] == ["a", "c", "d"]
    assert list(sched.waiting) == [b]
    # a swapped-out sequence of adapter 2 does not come back while adapter 1 runs
    for s in out.scheduled:
        s.seq.num_computed_tokens += s.num_new_tokens
    sched.waiting.clear()
    bm.swap_out([c])
    sched.leave_running(c)
    c.lora_request, c.status = LoRARequest("l2", 2, "/x"), SequenceStatus.SWAPPED
    sched.swapped.append([c])
    out = sched.schedule()
    assert c not in [s.seq for s in out.scheduled] and sched.swapped
