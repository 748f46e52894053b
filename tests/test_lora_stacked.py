"""The stacked shrink (minipaged/lora/layers.py, triton_punica.py): around a plain nn.Linear (or
the fused layers' FusedLinear) the slots' A sit under the base weight in one tensor, so on CUDA one GEMM gives the base output and
every slot's shrink, and one expand kernel adds each token's delta. Checked against the torch
reference (punica.py) under the Triton interpreter on the CPU (the same source runs on CUDA;
tests/test_gpu.py runs the engine there)."""
from __future__ import annotations

import json
import os

import pytest
import torch
from torch import nn

from minipaged import LLM, LoRARequest, SamplingParams
from minipaged.lora import punica
from minipaged.lora.layers import LoRALinear, stackable
from minipaged.lora.punica import PunicaWrapper
from minipaged.lora.triton_punica import TritonPunicaWrapper
from minipaged.lora.random_adapter import save_random_adapter
from minipaged.models.config import ModelConfig
from minipaged.models.loader import resolve_builtin
from tests.helpers import IGNORE_INTERPRETER_WARNINGS


def _needs_kernels():
    pytest.importorskip("triton")
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("no GPU and TRITON_INTERPRET is not set")


def _fused_linear():
    """FusedLinear (its module imports Triton kernels: only where they can run)."""
    _needs_kernels()
    from minipaged.models.fused_layers import FusedLinear
    return FusedLinear


BASES = [pytest.param(lambda: nn.Linear, id="nn.Linear"), pytest.param(_fused_linear, id="FusedLinear")]


def _layer(slices, k, max_loras, rank, bias, wrapper_cls, seed, base_cls=nn.Linear):
    g = torch.Generator().manual_seed(seed)
    base = base_cls(k, sum(slices), bias=bias)
    with torch.no_grad():
        base.weight.copy_(torch.randn(sum(slices), k, generator=g) * 0.1)
        if bias:
            base.bias.copy_(torch.randn(sum(slices), generator=g))
    wrapper = wrapper_cls(max_loras, 256, torch.device("cpu"))
    layer = LoRALinear(base, slices, k, max_loras, rank, wrapper, torch.float32,
                       torch.device("cpu"))
    for slot in range(max_loras):
        layer.set_slot(slot, [(torch.randn(rank - s % 2, k, generator=g),
                               torch.randn(size, rank - s % 2, generator=g)) if s != 1 else None
                              for s, size in enumerate(slices)])
    wrapper.scaling.copy_(torch.rand(max_loras, generator=g) + 0.5)
    return layer, wrapper, g


@pytest.mark.parametrize("base_cls", BASES)
def test_the_base_weight_is_a_view_of_the_stacked_tensor(base_cls):
    layer, _, g = _layer([24, 8, 8], 32, 3, 4, True, PunicaWrapper, seed=0, base_cls=base_cls())
    w = layer.base_layer.weight
    assert w.data_ptr() == layer.w_cat.data_ptr() and layer.w_cat.shape == (40 + 3 * 12, 32)
    assert layer.lora_a.data_ptr() == layer.w_cat[40:].data_ptr()  # the slots live under it
    assert layer.base_layer.bias.data_ptr() == layer.b_cat.data_ptr()
    layer.set_slot(1, [(torch.ones(4, 32), torch.ones(24, 4)), None, None])
    assert torch.equal(layer.w_cat[40 + 12:40 + 16], torch.ones(4, 32))
    x = torch.randn(5, 32, generator=g)
    torch.testing.assert_close(layer.base_layer(x), x @ w.T + layer.base_layer.bias)


def test_only_layers_computing_x_w_plus_b_are_stacked():
    class AllReduced(nn.Linear):  # like RowParallelLinear: more than x W^T + b after the GEMM
        pass

    assert stackable(nn.Linear(4, 4)) and not stackable(AllReduced(4, 4))
    assert stackable(_fused_linear()(4, 4)) and not stackable(nn.Identity())


@IGNORE_INTERPRETER_WARNINGS
@pytest.mark.parametrize("base_cls", BASES)
@pytest.mark.parametrize("num_tokens,max_loras,bias", [(1, 1, False), (3, 2, True),
                                                       (19, 3, True), (70, 4, False)])
def test_stacked_layer_equals_the_reference(num_tokens, max_loras, bias, base_cls):
    """With a FusedLinear base, steps of <= SKINNY_MAX_ROWS tokens without adapters run its
    GEMV kernel; with adapters, the stacked GEMM."""
    _needs_kernels()
    layer, wrapper, g = _layer([24, 8, 8], 48, max_loras, 8, bias, TritonPunicaWrapper,
                               seed=num_tokens, base_cls=base_cls())
    x = torch.randn(num_tokens, 48, generator=g)
    token_lora = torch.randint(-1, max_loras, (num_tokens,), generator=g)
    token_lora[0] = 0  # at least one token with an adapter
    wrapper.update(token_lora.tolist())
    want = punica.add_lora(layer.base_layer(x), x, layer.lora_a, layer.lora_b, wrapper.scaling,
                           token_lora)
    got = layer(x)
    assert got.stride(0) == 40 + max_loras * 3 * 8  # one GEMM's output: rows strided
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    wrapper.update([-1] * num_tokens)  # no adapter token: the base layer alone
    torch.testing.assert_close(layer(x), layer.base_layer(x))


def test_engine_uses_the_stacked_gemm_and_gives_the_reference_tokens(tmp_path, monkeypatch):
    """The engine with the CUDA variant (under the interpreter): every wrapped layer of
    stories260K is stacked, the GEMM runs, and the tokens are the torch reference's."""
    _needs_kernels()
    from minipaged.lora import triton_punica
    cfg = ModelConfig.from_dict(json.load(open(resolve_builtin("stories260K") / "config.json")))
    loras = [LoRARequest(f"a{i}", i + 1, save_random_adapter(str(tmp_path / f"a{i}"), cfg,
                                                             rank=8, lora_alpha=16, seed=i,
                                                             std=0.3)) for i in range(2)]
    llm = LLM("stories260K", device="cpu", enable_lora=True, max_loras=2, max_lora_rank=8,
              num_blocks=64, seed=0)
    prompts = ["Once upon a time", "The cat", "Lily went", "Tom had"]
    per_prompt = [loras[0], None, loras[1], loras[0]]
    sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False,
                                                         lora_request=per_prompt)]
    manager = llm.engine.lora_manager
    assert all(layer.w_cat is not None for layer in manager.layers.values())
    calls = []
    stacked = triton_punica.stacked_shrink_and_base
    monkeypatch.setattr(triton_punica, "stacked_shrink_and_base",
                        lambda *a: calls.append(1) or stacked(*a))
    manager.punica.__class__ = TritonPunicaWrapper  # every layer shares it
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False,
                                                        lora_request=per_prompt)]
    assert got == want and calls
    assert want[0] != want[1]
