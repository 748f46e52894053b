"""The `cpu_threads` knob (worker/cpu_threads.py): what `resolve` decides, and what the engine sets.

torch's thread count is process-wide, and the suite runs with one thread (conftest.py): every
test here puts it back afterwards. OMP_NUM_THREADS / MKL_NUM_THREADS (the suite may run under
OMP_NUM_THREADS=1) are removed where a test needs torch's own default.
"""
import argparse
import os
import subprocess
import sys

import pytest
import torch

from minipaged import LLM, EngineConfig
from minipaged.cli.args import add_engine_args, engine_kwargs
from minipaged.models.config import ModelConfig
from minipaged.models.loader import resolve_model
from minipaged.worker.cpu_threads import (THREAD_ENV_VARS, apply_cpu_threads,
                                          caller_chose_threads, resolve_cpu_threads,
                                          torch_default_threads)

SMALL = dict(num_blocks=32, max_model_len=128, max_num_seqs=4)  # a cheap stories260K engine


@pytest.fixture(autouse=True)
def restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.fixture
def torch_default(monkeypatch):
    """No thread variables in the environment and torch at its own default: no caller choice."""
    for var in THREAD_ENV_VARS:
        monkeypatch.delenv(var, raising=False)
    torch.set_num_threads(torch_default_threads())
    assert caller_chose_threads() is None


def model_config(name: str) -> ModelConfig:
    return ModelConfig.from_dict(resolve_model(name).config)


def test_stories260k_resolves_to_one_thread(torch_default):
    cfg = EngineConfig(model="stories260K", device="cpu").resolve(model_config("stories260K"))
    assert cfg.cpu_threads == 1
    assert torch.get_num_threads() == torch_default_threads()  # resolve decides, it sets nothing


def test_wide_model_resolves_to_a_thread_per_core(torch_default):
    cfg = EngineConfig(model="dummy:qwen3-0.6b", device="cpu").resolve(
        model_config("dummy:qwen3-0.6b"))  # hidden size 1024
    assert cfg.cpu_threads == torch_default_threads()


def test_engine_applies_the_auto_choice(torch_default):
    if torch_default_threads() == 1:
        pytest.skip("one physical core: the auto choice is torch's default")
    llm = LLM("stories260K", device="cpu", **SMALL)
    assert llm.config.cpu_threads == 1
    assert torch.get_num_threads() == 1


@pytest.mark.parametrize("threads", [2, 3])
def test_explicit_cpu_threads_is_applied(torch_default, threads):
    llm = LLM("stories260K", device="cpu", cpu_threads=threads, **SMALL)
    assert llm.config.cpu_threads == threads
    assert torch.get_num_threads() == threads


def test_explicit_cpu_threads_wins_over_the_callers_setting(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    LLM("stories260K", device="cpu", cpu_threads=2, **SMALL)
    assert torch.get_num_threads() == 2


def test_callers_set_num_threads_is_kept(torch_default):
    theirs = torch_default_threads() + 1  # not torch's default, not stories260K's auto (1)
    torch.set_num_threads(theirs)
    assert "set_num_threads" in caller_chose_threads()
    llm = LLM("stories260K", device="cpu", **SMALL)
    assert llm.config.cpu_threads == theirs
    assert torch.get_num_threads() == theirs


def _threads_in_fresh_process(env: dict) -> tuple[int, int, str]:
    """(torch threads before the engine, after it, the resolved cpu_threads) in a new process."""
    code = ("import torch; before = torch.get_num_threads()\n"
            "from minipaged import LLM\n"
            f"llm = LLM('stories260K', device='cpu', **{SMALL!r})\n"
            "print(before, torch.get_num_threads(), llm.config.cpu_threads)\n")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=240, check=True).stdout.split()
    return int(out[0]), int(out[1]), out[2]


def _env_without_thread_vars() -> dict:
    return {k: v for k, v in os.environ.items() if k not in THREAD_ENV_VARS}


def test_omp_num_threads_in_the_environment_is_respected():
    env = _env_without_thread_vars() | {"OMP_NUM_THREADS": "2"}
    before, after, resolved = _threads_in_fresh_process(env)
    if before == 1:
        pytest.skip("torch capped OMP_NUM_THREADS=2 to 1 here: nothing to tell apart")
    assert (after, resolved) == (before, str(before))  # not stories260K's auto choice of 1


def test_fresh_process_without_settings_gets_one_thread():
    """The README's first snippet in a new process: stories260K runs on one thread."""
    before, after, resolved = _threads_in_fresh_process(_env_without_thread_vars())
    assert before == torch_default_threads()  # what the rule takes for "no choice"
    assert (after, resolved) == (1, "1")


def test_cuda_leaves_threads_alone(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # resolve only; nothing runs
    torch.set_num_threads(3)
    mc = model_config("stories260K")
    cfg = EngineConfig(model="stories260K", device="cuda").resolve(mc)
    assert cfg.cpu_threads is None
    apply_cpu_threads(cfg.cpu_threads)
    assert torch.get_num_threads() == 3
    # An explicit value is the caller's word on any device.
    explicit = EngineConfig(model="stories260K", device="cuda", cpu_threads=2).resolve(mc)
    assert explicit.cpu_threads == 2
    assert resolve_cpu_threads(None, "cuda:1", 4096) is None


def test_cpu_threads_must_be_positive():
    with pytest.raises(ValueError, match="^cpu_threads"):
        EngineConfig(cpu_threads=0).validate()


def test_cpu_threads_flag():
    ap = argparse.ArgumentParser()
    add_engine_args(ap)
    assert engine_kwargs(ap.parse_args(["--cpu-threads", "2"]))["cpu_threads"] == 2
    assert engine_kwargs(ap.parse_args([]))["cpu_threads"] is None
