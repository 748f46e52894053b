"""Tensor parallelism on the CPU with gloo (minipaged/distributed/, models/parallel_layers.py).

* each parallel layer equals its unsharded torch.nn.functional op, with one full random weight
  cut by the shard loaders (the embedding with ids at the shard boundaries), on 2 processes;
* safetensors shards read with get_slice equal the cut tensors; dummy weights shard the same way;
* greedy tokens at tensor_parallel_size=2 equal N=1 and HF: stories260K under preemption and
  chunked prefill with mixed-length concurrent prompts, and under swap preemption, random Llama / Qwen2 / Qwen3 in float64;
* the teaching errors; a killed worker, and one that raises, give a clear error and no hang; workers stop with the
  engine and when the driver dies.
"""
import gc
import os
import signal
import subprocess
import sys
import textwrap
import time
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from minipaged import LLM, SamplingParams
from minipaged.models.parallel_layers import read_shard, shard_dim, shard_of
from tests.test_parity import random_prompts

pytestmark = pytest.mark.skipif(not dist.is_gloo_available(), reason="needs torch's gloo")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def greedy(n):
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


# --- the layers, rank by rank -----------------------------------------------------------------
def _layers_rank(rank: int, world: int, port: int, results):
    """One rank: every parallel layer against the unsharded F op on the same full weights.

    The column layer multiplies a 6-row shard of the weight, the reference all 12 rows: two GEMM
    shapes that a BLAS may block and round differently (1.8e-15 apart on one AMD EPYC), so it is
    compared in float64 with atol 1e-12 and rtol 0. That is ~1,000x the rounding seen and far
    below a wrong shard's error (the other rank's rows differ by O(1): checked by hand). The
    embedding is a gather and the other ranks add exact zeros, so it stays bit-exact; the row
    layer and the LM head sum partial products across ranks (allclose's defaults)."""
    from minipaged.distributed.parallel_state import destroy_groups, init_groups
    from minipaged.models.parallel_layers import (ColumnParallelLinear, ParallelLMHead,
                                                  RowParallelLinear, VocabParallelEmbedding)
    torch.set_num_threads(1)
    tp = init_groups(rank, world, False, f"tcp://127.0.0.1:{port}")
    try:
        gen = torch.Generator().manual_seed(0)  # the same full tensors on every rank
        x = torch.randn(5, 16, generator=gen, dtype=torch.float64)
        w_col = torch.randn(12, 16, generator=gen, dtype=torch.float64)
        b_col = torch.randn(12, generator=gen, dtype=torch.float64)
        w_row = torch.randn(16, 12, generator=gen, dtype=torch.float64)
        w_emb = torch.randn(10, 16, generator=gen, dtype=torch.float64)
        h = torch.randn(5, 12, generator=gen, dtype=torch.float64)  # the row layer's input
        checks = {}

        col = ColumnParallelLinear(16, 12 // world, True, tp).double()
        col.weight.data.copy_(shard_of(w_col, shard_dim("q_proj.weight"), rank, world))
        col.bias.data.copy_(shard_of(b_col, shard_dim("q_proj.bias"), rank, world))
        y = col(x)  # this rank's columns of the full output
        want = shard_of(F.linear(x, w_col, b_col), 1, rank, world)
        checks["column"] = torch.allclose(y, want, rtol=0, atol=1e-12)

        row = RowParallelLinear(12 // world, 16, False, tp).double()
        row.weight.data.copy_(shard_of(w_row, shard_dim("o_proj.weight"), rank, world))
        y = row(shard_of(h, 1, rank, world))  # its share of the inputs, then the all-reduce
        checks["row"] = torch.allclose(y, F.linear(h, w_row))

        emb = VocabParallelEmbedding(10, 16, tp).double()
        emb.weight.data.copy_(shard_of(w_emb, shard_dim("model.embed_tokens.weight"), rank, world))
        per = 10 // world
        ids = torch.tensor([0, per - 1, per, 9, per - 1, 3])  # both sides of every boundary
        checks["embedding"] = torch.equal(emb(ids), F.embedding(ids, w_emb))

        head = ParallelLMHead(tp)
        logits = head(x, shard_of(w_emb, shard_dim("lm_head.weight"), rank, world))
        checks["lm_head"] = (torch.allclose(logits, F.linear(x, w_emb)) if rank == 0
                             else logits is None)
        results.put((rank, checks))
    finally:
        destroy_groups()


def test_parallel_layers_equal_unsharded_ops():
    from minipaged.distributed.parallel_state import free_port
    ctx = torch.multiprocessing.get_context("spawn")
    results, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=_layers_rank, args=(r, 2, port, results)) for r in range(2)]
    for p in procs:
        p.start()
    got = dict(results.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(30)
    assert set(got) == {0, 1}
    for rank, checks in got.items():
        assert all(checks.values()), (rank, checks)


def test_safetensors_shards_read_only_their_slice(tmp_path):
    from safetensors import safe_open
    from safetensors.torch import save_file
    full = {"model.layers.0.self_attn.q_proj.weight": torch.randn(8, 6),
            "model.layers.0.self_attn.q_proj.bias": torch.randn(8),
            "model.layers.0.self_attn.o_proj.weight": torch.randn(6, 8),
            "model.layers.0.input_layernorm.weight": torch.randn(6),
            "model.embed_tokens.weight": torch.randn(10, 6)}
    save_file(full, str(tmp_path / "model.safetensors"))
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as sf:
        for rank in range(2):
            for name, t in full.items():
                part = read_shard(sf, name, rank, 2)
                assert torch.equal(part, shard_of(t, shard_dim(name), rank, 2)), name
    assert shard_dim("model.layers.0.self_attn.o_proj.weight") == 1
    assert shard_dim("model.layers.0.input_layernorm.weight") is None


def test_dummy_weights_shard_like_the_single_device_ones():
    """Rank r's dummy weights are its cut of the N=1 dummy weights (no process group needed:
    loading touches none)."""
    from minipaged.attention import get_attention_backend
    from minipaged.distributed.parallel_state import TPGroup
    from minipaged.models.config import ModelConfig
    from minipaged.models.llama import LlamaForCausalLM
    from minipaged.models.parallel_llama import TensorParallelLlamaForCausalLM
    cfg = ModelConfig.from_dict(dict(architectures=["Qwen2ForCausalLM"], vocab_size=32,
                                     hidden_size=16, intermediate_size=24, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2))
    backend = get_attention_backend("torch_ref", "cpu")
    full = LlamaForCausalLM(cfg, backend, 64)
    full.init_dummy_weights(5)
    params = dict(full.named_parameters())
    q, kv = 4 * 4, 2 * 4
    for rank in range(2):
        tp = TPGroup(rank, 2, None, None, "gloo")
        part = TensorParallelLlamaForCausalLM(cfg, backend, 64, full.layer_set, tp)
        part.init_dummy_weights(5)
        for name, p in part.named_parameters():
            w = params[name]
            if ".qkv_proj." in name:
                pieces = w.split([q, kv, kv])
                want = torch.cat([shard_of(t, 0, rank, 2) for t in pieces])
            elif ".gate_up_proj." in name:
                want = torch.cat([shard_of(t, 0, rank, 2) for t in w.chunk(2)])
            else:
                want = shard_of(w, shard_dim(name), rank, 2)
            assert torch.equal(p, want), name


# --- the engine at N = 2 ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def stories_hf():
    from minipaged.lessons.baseline import load_hf_model
    from minipaged.models.loader import resolve_builtin
    return load_hf_model(str(resolve_builtin("stories260K")))


def test_stories260k_tp2_equals_tp1_and_hf_under_preemption_and_chunked_prefill(stories_hf):
    """24 mixed-length prompts at once in a cache too small for them (recompute preemptions) and
    a 32-token budget (prefill chunks beside decodes): each rank holds 2 of the 4 KV heads."""
    from tests.helpers import hf_greedy
    prompts = random_prompts(24, 512, 2, 60, seed=7)
    lengths = [4 + (7 * i) % 27 for i in range(len(prompts))]
    kw = dict(block_size=8, num_blocks=24, max_model_len=128, max_num_batched_tokens=32,
              enable_prefix_caching=False)
    llm = LLM("stories260K", tensor_parallel_size=2, **kw)
    assert llm.engine.kv_cache.shape[-2] == 2  # this rank's share of the 4 KV heads
    outs = [o.outputs[0].token_ids for o in
            llm.generate(prompts, [greedy(n) for n in lengths], use_tqdm=False)]
    trace = llm.engine.trace
    assert sum(len(r.preempted) for r in trace) > 0
    assert any(r.num_prefill_tokens and r.num_decode_tokens for r in trace)
    workers = llm.engine.model.tp.workers
    procs = list(workers.procs.values())
    del llm, trace
    gc.collect()  # the engine's shards go, and its workers with them
    assert all(not p.is_alive() for p in procs) and not dist.is_initialized()
    one = LLM("stories260K", **kw)
    assert outs == [o.outputs[0].token_ids for o in
                    one.generate(prompts, [greedy(n) for n in lengths], use_tqdm=False)]
    assert outs == hf_greedy(stories_hf, prompts, lengths)


def test_stories260k_tp2_swap_preemption_equals_tp1(stories_hf):
    """preemption_mode='swap' with N = 2: every rank copies its shard of a victim's blocks to
    its own CPU pool and back, in the step the driver's scheduler planned."""
    prompts = random_prompts(16, 512, 2, 40, seed=11)
    lengths = [8 + (5 * i) % 25 for i in range(len(prompts))]
    kw = dict(block_size=8, num_blocks=20, max_model_len=128, enable_prefix_caching=False,
              preemption_mode="swap")
    llm = LLM("stories260K", tensor_parallel_size=2, **kw)
    outs = [o.outputs[0].token_ids for o in
            llm.generate(prompts, [greedy(n) for n in lengths], use_tqdm=False)]
    swapped = sum(len(r.swapped_out or []) for r in llm.engine.trace)
    del llm
    gc.collect()
    assert swapped > 0  # the workload did swap (the workers' copies were needed)
    one = LLM("stories260K", **kw)
    assert outs == [o.outputs[0].token_ids for o in
                    one.generate(prompts, [greedy(n) for n in lengths], use_tqdm=False)]


def _tiny_hf(family: str, path, vocab=96):
    """A random float64 model whose vocabulary splits two ways (helpers' has 97 words)."""
    from transformers import (LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM,
                              Qwen3Config, Qwen3ForCausalLM)
    common = dict(vocab_size=vocab, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                  bos_token_id=1, eos_token_id=2, initializer_range=0.2,
                  tie_word_embeddings=family == "qwen3")
    cls, cfg = {"llama": (LlamaForCausalLM, LlamaConfig(**common)),
                "qwen2": (Qwen2ForCausalLM, Qwen2Config(**common)),
                "qwen3": (Qwen3ForCausalLM, Qwen3Config(**common, head_dim=16))}[family]
    torch.manual_seed(1)
    model = cls(cfg).to(torch.float64).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            attn = layer.self_attn
            for proj in (attn.q_proj, attn.k_proj, attn.v_proj):
                if proj.bias is not None:  # Qwen2: biases shard with their heads
                    proj.bias.normal_(0, 0.5)
            if family == "qwen3":
                attn.q_norm.weight.uniform_(0.5, 1.5)
                attn.k_norm.weight.uniform_(0.5, 1.5)
    model.save_pretrained(str(path))
    return model


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_random_models_tp2_equal_hf_in_float64(tmp_path, family):
    from tests.helpers import hf_greedy
    hf = _tiny_hf(family, tmp_path)
    prompts = random_prompts(6, 96, 2, 30, seed=3)
    llm = LLM(str(tmp_path), tensor_parallel_size=2, dtype="float64", block_size=4,
              num_blocks=40, max_num_batched_tokens=24, enable_prefix_caching=False)
    outs = llm.generate(prompts, greedy(12), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(hf, prompts, 12)


# --- errors -----------------------------------------------------------------------------------
def test_indivisible_heads_and_too_many_gpus_teach():
    with pytest.raises(ValueError, match=r"num_attention_heads=8.*8 / 3 = 2\.67.*in \[1, 2, 4\]"):
        LLM("stories260K", tensor_parallel_size=3)
    with pytest.raises(ValueError, match=r"num_key_value_heads=4.*in \[1, 2, 4\]"):
        LLM("stories260K", tensor_parallel_size=8)
    from minipaged.distributed.parallel_state import check_tensor_parallel
    from minipaged.models.config import ModelConfig
    from minipaged.models.loader import resolve_model
    model_cfg = ModelConfig.from_dict(resolve_model("stories260K").config)
    cfg = SimpleNamespace(tensor_parallel_size=2, preemption_mode="recompute", is_cuda=True)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch.cuda, "device_count", lambda: 1)
        with pytest.raises(ValueError, match=r"needs 2 GPUs .* this machine has 1"):
            check_tensor_parallel(cfg, model_cfg)
    assert not dist.is_initialized()  # refused before any process started


def test_8b_preset_has_qwen3_8b_shape_and_splits_up_to_8_ways():
    """dummy:qwen3-8b, the 8B-class shape for multi-GPU scaling runs: Qwen3-8B's 8.19 B
    parameters and 144 KiB of bf16 K/V per token, and its heads, MLP and vocabulary divide by
    N = 2, 4 and 8 (3 is refused with the sizes that would work)."""
    from minipaged.distributed.parallel_state import check_tensor_parallel
    from minipaged.models.config import ModelConfig
    from minipaged.models.loader import resolve_model
    c = ModelConfig.from_dict(resolve_model("dummy:qwen3-8b").config)
    assert round(c.num_parameters() / 1e9, 2) == 8.19 and not c.tie_word_embeddings
    assert c.kv_bytes_per_token(torch.bfloat16) == 36 * 2 * 8 * 128 * 2
    for n in (2, 4, 8):
        check_tensor_parallel(SimpleNamespace(tensor_parallel_size=n, preemption_mode="recompute",
                                              is_cuda=False), c)
    with pytest.raises(ValueError, match=r"in \[1, 2, 4, 8\]"):
        check_tensor_parallel(SimpleNamespace(tensor_parallel_size=3, preemption_mode="recompute",
                                              is_cuda=False), c)


def test_kv_cache_error_counts_per_rank():
    with pytest.raises(ValueError, match=r"320.00 KiB \(640 bytes per token.*per rank: with "
                                         r"tensor_parallel_size=2 each of the 2 processes holds "
                                         r"2 of the 4 KV heads"):
        LLM("stories260K", tensor_parallel_size=2, num_blocks=2, block_size=16)
    gc.collect()  # the half-built engine's workers stop with its shards
    assert not dist.is_initialized()


def test_killed_worker_gives_a_clear_error_not_a_hang():
    llm = LLM("stories260K", tensor_parallel_size=2)
    llm.generate("Once upon a time", greedy(4), use_tqdm=False)
    proc = llm.engine.model.tp.workers.procs[1]
    os.kill(proc.pid, signal.SIGKILL)
    proc.join(10)
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=r"worker rank 1 .* killed by SIGKILL"):
        llm.generate(random_prompts(8, 512, 5, 40, seed=1), greedy(20), use_tqdm=False)
    assert time.monotonic() - t0 < 30
    with pytest.raises(RuntimeError, match="rank 1"):  # and again, at once
        llm.generate("Once upon a time", greedy(4), use_tqdm=False)
    del llm
    gc.collect()
    assert not dist.is_initialized()


def test_worker_that_raises_is_named_with_its_traceback():
    """A worker that raises (not killed): the driver's next step fails at once with that rank's
    traceback quoted, every later call too, and nothing is left running."""
    from minipaged.distributed.step_inputs import send_header
    llm = LLM("stories260K", tensor_parallel_size=2)
    llm.generate("Once upon a time", greedy(4), use_tqdm=False)
    tp = llm.engine.model.tp
    send_header(tp.cpu_group, 99)  # a message the worker's loop does not know: it raises
    proc = tp.workers.procs[1]
    proc.join(20)
    assert proc.exitcode == 1  # it reported its error and exited
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=r"(?s)worker rank 1 .* raised:.*RuntimeError: "
                                           r"unexpected message 99 from the driver"):
        llm.generate(random_prompts(4, 512, 5, 20, seed=2), greedy(8), use_tqdm=False)
    assert time.monotonic() - t0 < 30
    with pytest.raises(RuntimeError, match="unexpected message 99"):  # and again, at once
        llm.generate("Once upon a time", greedy(4), use_tqdm=False)
    del llm
    gc.collect()
    assert not dist.is_initialized()


def test_workers_exit_when_the_driver_dies(tmp_path):
    script = textwrap.dedent("""
        import sys, time, torch
        torch.set_num_threads(1)
        from minipaged import LLM
        llm = LLM("stories260K", tensor_parallel_size=2)
        print(llm.engine.model.tp.workers.procs[1].pid, flush=True)
        time.sleep(600)
    """)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO)
    driver = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                              env=env, cwd=REPO)
    try:
        worker_pid = int(driver.stdout.readline())
        driver.kill()  # SIGKILL: no exit handler runs in the driver
        driver.wait(10)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and _alive(worker_pid):
            time.sleep(0.2)
        assert not _alive(worker_pid)
    finally:
        driver.kill()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def _descendants(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-eo", "pid=,ppid="], capture_output=True, text=True).stdout
    children: dict[int, list[int]] = {}
    for line in out.split("\n"):
        if line.strip():
            p, pp = map(int, line.split())
            children.setdefault(pp, []).append(p)
    found, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            found.append(c)
            todo.append(c)
    return found


def test_serve_tensor_parallel_answers_the_openai_client():
    """`minipaged serve --tensor-parallel-size 2`: the engine core process is the driver; SIGTERM
    ends the server, its core and the core's worker."""
    import httpx
    import openai
    from minipaged.distributed.parallel_state import free_port
    port = free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO)
    proc = subprocess.Popen([sys.executable, "-m", "minipaged.cli", "serve", "stories260K",
                             "--tensor-parallel-size", "2", "--port", str(port), "--device",
                             "cpu", "--uvicorn-log-level", "warning"], env=env, cwd=REPO,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, "server did not start"
            time.sleep(0.2)
        kids = _descendants(proc.pid)
        assert len(kids) >= 2  # the engine core and its tensor-parallel worker
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x",
                               max_retries=0, timeout=60)
        out = client.completions.create(model="stories260K", prompt="Once upon a time",
                                        max_tokens=20, temperature=0)
        assert out.choices[0].text.startswith(", there was a little girl named Lily.")
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and any(_alive(k) for k in kids):
            time.sleep(0.2)
        assert not any(_alive(k) for k in kids)
    finally:
        proc.kill()


def test_torchrun_env_init(tmp_path):
    """env:// (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT from torchrun): rank 0's LLM(...) is the
    engine, rank 1's runs the worker loop and its process exits when the driver is done."""
    from minipaged.distributed.parallel_state import free_port
    from tests.helpers import STORIES_EXPECTED
    script = tmp_path / "tp_script.py"
    script.write_text(textwrap.dedent("""
        import torch
        torch.set_num_threads(1)
        from minipaged import LLM, SamplingParams
        llm = LLM("stories260K", tensor_parallel_size=2)
        out = llm.generate("Once upon a time", SamplingParams(temperature=0, max_tokens=40),
                           use_tqdm=False)[0]
        print("TOKENS", out.prompt_token_ids + out.outputs[0].token_ids, flush=True)
    """))
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    if not os.path.exists(torchrun):
        pytest.skip("no torchrun beside this python")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO)
    run = subprocess.run([torchrun, "--nproc-per-node", "2", "--master-port", str(free_port()),
                          str(script)], env=env, cwd=REPO, capture_output=True, text=True,
                         timeout=180)
    assert run.returncode == 0, run.stderr[-3000:]
    lines = [line for line in run.stdout.splitlines() if line.startswith("TOKENS")]
    assert lines == [f"TOKENS {STORIES_EXPECTED}"]  # printed by rank 0 only
