"""Lesson 09's helpers (minipaged/lessons/tp.py): the shards it draws are the checkpoint's
tensors cut by the engine's loader, its message table is what the real forward sends, and its
measurements come back from spawned gloo ranks."""
import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from minipaged.lessons import tp, tp_measure  # noqa: E402
from minipaged.models.config import ModelConfig  # noqa: E402
from minipaged.models.parallel_layers import shard_dim, shard_of  # noqa: E402

pytestmark = pytest.mark.skipif(not dist.is_gloo_available(), reason="needs torch's gloo")


def test_shards_are_the_loaders_slices_and_reassemble():
    full, shards, cfg = tp.load_shards("stories260K", world_size=2)
    assert set(shards[0]) == set(full)
    for name, t in full.items():
        for rank, s in enumerate(shards):
            assert torch.equal(s[name], shard_of(t, shard_dim(name), rank, 2)), name
        assert torch.equal(tp.reassemble(name, shards), t), name
    rows = {name: (whole, mine, dim) for name, whole, mine, dim in tp.shard_table(full, shards)}
    assert rows["model.layers.0.self_attn.k_proj.weight"] == ((32, 64), (16, 64), 0)
    assert rows["model.layers.0.mlp.down_proj.weight"] == ((64, 172), (64, 86), 1)
    assert rows["model.norm.weight"] == ((64,), (64,), None)
    assert not any(".layers.1." in name for name in rows)
    for fig in (tp.plot_weight_shards(full, shards, cfg), tp.plot_layer_dataflow(cfg, 2, 8),
                tp.plot_kv_block(torch.randn(16, 4, 8), torch.randn(16, 2, 8), cfg, 2)):
        plt.close(fig)


def test_step_messages():
    cfg = ModelConfig.from_dict(tp.model_source("stories260K").config)
    msgs = tp.step_messages(cfg, num_seqs=32, world_size=2)
    assert tp.collective_counts(msgs) == {"all_reduce [32, 64]": 11, "gather [32, 256]": 1}
    assert {m.bytes for m in msgs if m.op == "all_reduce"} == {32 * 64 * 4}
    from minipaged.lessons.figures import QWEN25_7B
    qwen = tp.step_messages(ModelConfig.from_dict(QWEN25_7B), num_seqs=64, world_size=4,
                            dtype=torch.bfloat16)
    assert tp.collective_counts(qwen)["all_reduce [64, 3584]"] == 57  # the lesson's exercise
    assert {m.bytes for m in qwen if m.op == "all_reduce"} == {64 * 3584 * 2}


def test_measure_counts_the_real_forwards_collectives():
    """Two spawned ranks run stories260K's step the engine's way; the collectives counted inside
    its forward are step_messages' table, and every time is positive."""
    out = tp_measure.measure(2, models=("stories260K",), num_seqs=4, context_len=20, sizes=(1024,),
                     repeats=2, sweep_repeats=2)
    (s,) = out["steps"]
    cfg = ModelConfig.from_dict(tp.model_source("stories260K").config)
    assert s.collectives == tp.collective_counts(tp.step_messages(cfg, 4, 2))
    assert s.step_s > 0 and s.comm_s > 0 and s.compute_s > 0 and s.compute_cpu_s > 0
    rank0 = tp.load_shards("stories260K", 2)[1][0]
    assert s.params_per_rank == sum(t.numel() for t in rank0.values())
    assert set(out["all_reduce"]) == {1024} and out["all_reduce"][1024] > 0
    assert not dist.is_initialized()  # nothing joined a group in this process
    plt.close(tp.plot_step_split([s], cores=2))
    plt.close(tp.plot_all_reduce({2: out["all_reduce"]}, {"1 KiB": 1024}))


def test_random_configs_are_dummy_sources():
    wide = dict(tp.RANDOM_CONFIG, hidden_size=2048, intermediate_size=5632)
    src = tp.model_source(wide)
    assert src.dummy and src.path is None and src.config["hidden_size"] == 2048
    assert tp.model_label(wide) == "random, hidden 2048"
    assert tp.model_source(tp.RANDOM_NAME).config == tp.RANDOM_CONFIG
    assert ModelConfig.from_dict(src.config).num_parameters() > 4 * 10**7
