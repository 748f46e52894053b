"""One declaration of the engine's knobs: `EngineConfig` (config.py) is every `LLM(...)` keyword
and every engine flag of `minipaged generate | bench | serve` (cli/args.py), and
`EngineConfig.resolve` decides each "auto" once."""
import argparse
import re

import pytest

from minipaged import EngineConfig
from minipaged.cli.args import add_engine_args, engine_config_from_args, flag_names
from minipaged.cli import main
from minipaged.config import engine_fields
from minipaged.models.config import ModelConfig
from minipaged.models.loader import resolve_model


def _help(cmd: str, capsys) -> str:
    with pytest.raises(SystemExit):
        main([cmd, "--help"])
    return capsys.readouterr().out


def _engine_flags(text: str) -> set[str]:
    section = text.split("engine (EngineConfig):", 1)[1]
    section = re.split(r"\n\S", section, maxsplit=1)[0]  # up to the next group
    return set(re.findall(r"--[a-z][a-z0-9_-]*", section))


def test_generate_chat_bench_and_serve_list_the_same_engine_flags(capsys):
    commands = ("generate", "chat", "bench", "serve")
    flags = {cmd: _engine_flags(_help(cmd, capsys)) for cmd in commands}
    assert flags["generate"] == flags["chat"] == flags["bench"] == flags["serve"]
    for f in engine_fields():  # every field is a flag
        assert flag_names(f.name, twins=False)[0] in flags["serve"], f.name
    for name in ("--kv-cache-dtype", "--no-async-scheduling", "--no-fused-ops",
                 "--no-enable-prefix-caching", "--preemption-mode", "--swap-space",
                 "--download-dir", "--revision", "--max-loras", "--max-cpu-loras"):
        assert name in flags["serve"]


def test_underscore_spellings_and_auto(capsys):
    from minipaged.cli.serve import parse_args
    a = parse_args(["--max_model_len", "64", "--no-enable_prefix_caching", "--api_key", "k",
                    "--attention-backend", "auto", "--num-blocks", "auto"])
    assert (a.max_model_len, a.enable_prefix_caching, a.api_key) == (64, False, "k")
    assert parse_args(["-tp", "2"]).tensor_parallel_size == 2  # vLLM's short form
    assert a.attention_backend is None and a.num_blocks is None  # auto: EngineConfig decides
    text = _help("serve", capsys)
    backend = " ".join(text[text.index("\n  --attention-backend"):].split("\n  --", 2)[1].split())
    assert "{auto,torch_ref,cpu,triton}" in backend and "None" not in backend
    assert "(default: auto)" in backend


def test_flags_become_the_config_they_name():
    p = argparse.ArgumentParser()
    add_engine_args(p)
    cfg = engine_config_from_args(p.parse_args(
        ["dummy:qwen3-0.6b", "--max_model_len", "64", "--no-async-scheduling",
         "--kv-cache-dtype", "fp8", "--no-enable-prefix-caching", "--fused-ops",
         "--max-cpu-loras", "3"]))
    assert cfg.model == "dummy:qwen3-0.6b" and cfg.max_model_len == 64
    assert cfg.async_scheduling is False and cfg.fused_ops is True
    assert cfg.kv_cache_dtype == "fp8" and cfg.enable_prefix_caching is False
    assert cfg.max_cpu_loras == 3
    defaults = engine_config_from_args(p.parse_args([]))
    assert defaults == EngineConfig()  # no flag given: the dataclass's own defaults
    with pytest.raises(SystemExit):
        p.parse_args(["--kv-cache-dtype", "int4"])  # choices come from the field


def test_resolve_decides_every_auto_once_on_the_cpu():
    mc = ModelConfig.from_dict(resolve_model("stories260K").config)
    auto = EngineConfig(device="cpu")
    cfg = auto.resolve(mc)
    assert auto.max_model_len is None and auto.attention_backend is None  # the input is untouched
    assert cfg.device == "cpu" and cfg.dtype == "float32"
    assert cfg.attention_backend == "cpu" and cfg.fused_ops is False
    assert cfg.async_scheduling is False and cfg.max_model_len == mc.max_position_embeddings
    assert cfg.max_num_batched_tokens == 2048
    assert not (cfg.use_cuda_graphs or cfg.kv_head_major or cfg.gpu_tuned_inputs or cfg.sampler_kernel)
    assert cfg.resolve(mc) == cfg  # resolving again changes nothing
    forced = EngineConfig(device="cpu", async_scheduling=True, dtype="bfloat16").resolve(mc)
    assert forced.async_scheduling is True and forced.dtype == "bfloat16"


def test_resolve_rejects_cuda_without_a_gpu_and_bad_values():
    import torch
    mc = ModelConfig.from_dict(resolve_model("stories260K").config)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="sees no CUDA GPU"):
            EngineConfig(device="cuda").resolve(mc)
    with pytest.raises(ValueError, match="attention_backend"):
        EngineConfig(attention_backend="flash").resolve(mc)
    with pytest.raises(ValueError, match="max_position_embeddings=512"):
        EngineConfig(device="cpu", max_model_len=4096).resolve(mc)


def test_max_trace_len_bounds_the_trace():
    from minipaged import LLM, SamplingParams
    llm = LLM("stories260K", device="cpu", num_blocks=64, max_trace_len=5)
    llm.generate(["Once upon a time"], SamplingParams(temperature=0, max_tokens=20), use_tqdm=False)
    assert len(llm.engine.trace) == 5 and llm.engine.trace[-1].step >= 19  # the newest steps
    unbounded = LLM("stories260K", device="cpu", num_blocks=64)
    unbounded.generate(["Once upon a time"], SamplingParams(temperature=0, max_tokens=20),
                       use_tqdm=False)
    assert len(unbounded.engine.trace) >= 20


def test_the_step_budget_default_follows_the_device_and_the_use(monkeypatch):
    """An unset max_num_batched_tokens is chosen by `resolve` from the device and
    `usage_context` (vLLM's get_batch_defaults): 2048 on the CPU, 16384 offline and 8192 served
    on an H100/H200-class GPU, 8192 / 2048 on others (an A100 among them); an explicit value
    always wins; `minipaged serve` defaults to the server's column."""
    import types

    import minipaged.config as config_mod
    from minipaged.cli import serve
    from minipaged.config import EngineConfig, default_batched_tokens
    from minipaged.models.config import ModelConfig
    from minipaged.models.source import resolve_model

    assert default_batched_tokens("cpu", "offline") == default_batched_tokens("cpu", "server") == 2048
    gpus = {"NVIDIA H200": 140, "NVIDIA A100-SXM4-80GB": 80, "NVIDIA L4": 24}
    for name, gib in gpus.items():
        props = types.SimpleNamespace(name=name, total_memory=gib * 2**30)
        monkeypatch.setattr("torch.cuda.get_device_properties", lambda d, p=props: p)
        want = (16384, 8192) if name == "NVIDIA H200" else (8192, 2048)
        assert (default_batched_tokens("cuda", "offline"),
                default_batched_tokens("cuda", "server")) == want, name
    model_cfg = ModelConfig.from_dict(resolve_model("dummy:qwen3-0.6b").config)
    assert EngineConfig(device="cpu").resolve(model_cfg).max_num_batched_tokens == 2048
    assert EngineConfig(device="cpu", max_num_batched_tokens=512).resolve(
        model_cfg).max_num_batched_tokens == 512
    no_chunks = EngineConfig(device="cpu", enable_chunked_prefill=False, max_model_len=4096)
    assert no_chunks.resolve(model_cfg).max_num_batched_tokens == 4096
    assert serve.make_parser().parse_args([]).usage_context == "server"
    assert config_mod.EngineConfig().usage_context == "offline"
