"""Lesson 09's helpers: tensor parallelism drawn from the real shards and timed with gloo.

    load_shards(model, world_size)
        the full checkpoint tensors and each rank's slice, read by the project's shard loader
        (`parallel_llama.iter_safetensor_shards`: safetensors' get_slice, as the engine loads)
    plot_weight_shards(full, shards, cfg, layer)
        every weight matrix of one layer and the embedding, each rank's part drawn from its own
        shard tensor: column-parallel q/k/v and gate/up (rows), row-parallel o and down (columns)
    plot_layer_dataflow(cfg, world_size, num_tokens)
        one decoder layer's data flow across the ranks and its two all-reduces
    plot_kv_block(full_block, rank0_block, cfg, world_size)
        one block of layer 0's K cache at N=1 next to rank 0's at N
    step_messages(cfg, num_seqs, world_size, query_len, dtype), collective_counts(messages)
        what one engine step sends between the ranks: op, shape, bytes (the protocol of
        distributed/step_inputs.py and the layers of models/parallel_layers.py)
    plot_step_split(splits), plot_all_reduce(times, marks)
        the measurements of tp_measure.measure (spawned gloo ranks timing one step)

tests/test_lessons_tp.py checks the shards against the checkpoint, the message table against
the counts in the real forward, and that the measurements come back.

Nothing here is on the engine's path.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

RANK_COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd")
ALL_REDUCE_COLOR = "#d62728"

# A random Llama large enough that a step's compute is more than its communication on a CPU
# (about 64M parameters, a decode step of 32 sequences is ~3 GFLOP). Dummy weights, as the
# dummy presets use: every rank draws the single-device tensors and keeps its slice.
RANDOM_CONFIG = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=8192,
                     hidden_size=1024, intermediate_size=2816, num_hidden_layers=4,
                     num_attention_heads=16, num_key_value_heads=8, max_position_embeddings=1024,
                     rms_norm_eps=1e-5, tie_word_embeddings=False, hidden_act="silu",
                     bos_token_id=1, eos_token_id=2)
RANDOM_NAME = "random-64M"


# --- the shards ---------------------------------------------------------------------------------
def model_source(model):
    """`loader.resolve_model(model)` for a name; this lesson's random model for RANDOM_NAME; and
    for a dict (a Hugging Face style config, e.g. `dict(RANDOM_CONFIG, hidden_size=2048)`) a
    random model of those shapes. Dummy weights for the random ones, as the dummy presets."""
    from minipaged.models.loader import ModelSource, resolve_model
    if isinstance(model, dict):
        return ModelSource(name=model_label(model), config=dict(model), path=None, dummy=True)
    if model == RANDOM_NAME:
        return ModelSource(name=RANDOM_NAME, config=dict(RANDOM_CONFIG), path=None, dummy=True)
    return resolve_model(model)


def model_label(model) -> str:
    """The name a model goes by in StepSplit.model: its name, or a random config's width."""
    if isinstance(model, dict):
        return f"random, hidden {model['hidden_size']}"
    return model


def load_shards(model: str = "stories260K", world_size: int = 2):
    """(full, shards, cfg): every checkpoint tensor whole, each rank's dict of its slices (the
    engine's loader, `iter_safetensor_shards`), and the model's ModelConfig."""
    from minipaged.models.config import ModelConfig
    from minipaged.models.loader import iter_safetensors
    from minipaged.models.parallel_llama import iter_safetensor_shards
    source = model_source(model)
    full = dict(iter_safetensors(source.path))
    shards = [dict(iter_safetensor_shards(source.path, r, world_size)) for r in range(world_size)]
    return full, shards, ModelConfig.from_dict(source.config)


def reassemble(name: str, shards: Sequence[dict]) -> torch.Tensor:
    """The N slices of tensor `name` put back together along the dimension it was cut."""
    from minipaged.models.parallel_layers import shard_dim
    dim = shard_dim(name)
    parts = [s[name] for s in shards]
    return parts[0] if dim is None else torch.cat(parts, dim=dim)


def shard_table(full: dict, shards: Sequence[dict], layer: int = 0) -> list[tuple]:
    """(name, full shape, rank 0's shape, split dim or None) for one layer's tensors and the
    model-wide ones, as the loader read them."""
    from minipaged.models.parallel_layers import shard_dim
    rows = []
    for name, t in full.items():
        if ".layers." in name and f".layers.{layer}." not in name:
            continue
        rows.append((name, tuple(t.shape), tuple(shards[0][name].shape), shard_dim(name)))
    return rows


def _draw_matrix(ax, name, shards, dim, vmax, unit=None):
    """Each rank's slice of one weight, drawn from that rank's own tensor at its place.
    `unit` (size, what): label the slices in those units (heads of head_dim rows, ...)."""
    from matplotlib.patches import Rectangle
    offset = 0
    for r, shard in enumerate(shards):
        w = shard[name].float().numpy()
        rows, cols = w.shape
        x0, y0 = (offset, 0) if dim == 1 else (0, offset)
        ax.imshow(w, cmap="RdBu_r", vmin=-vmax, vmax=vmax, interpolation="nearest",
                  extent=(x0, x0 + cols, y0 + rows, y0))
        ax.add_patch(Rectangle((x0, y0), cols, rows, facecolor=RANK_COLORS[r], alpha=0.13,
                               edgecolor="none"))
        ax.add_patch(Rectangle((x0, y0), cols, rows, fill=False, edgecolor=RANK_COLORS[r],
                               linewidth=2.5))
        size = cols if dim == 1 else rows
        if unit is not None:
            per, what = unit
            span = f"{what} {offset // per}-{(offset + size) // per - 1}"
        else:
            span = f"{'cols' if dim == 1 else 'rows'} {offset}-{offset + size - 1}"
        ax.text(x0 + cols / 2, y0 + rows / 2, f"rank {r}\n{span}", ha="center", va="center",
                fontsize=8, color=RANK_COLORS[r], fontweight="bold",
                bbox=dict(facecolor="white", alpha=0.85, edgecolor="none", pad=1.5))
        offset += size
    if unit is not None and unit[0] > 1:  # head boundaries
        for b in range(unit[0], offset, unit[0]):
            (ax.axvline if dim == 1 else ax.axhline)(b, color="black", lw=0.6, alpha=0.6)
    ax.set_xlim(0, offset if dim == 1 else shards[0][name].shape[1])
    ax.tick_params(labelsize=7)


def plot_weight_shards(full: dict, shards: Sequence[dict], cfg, layer: int = 0):
    """Layer `layer`'s seven matrices and the embedding, with the rows / columns each rank
    holds. Every coloured part is drawn from that rank's shard; nn.Linear stores (out, in), so
    column-parallel layers split rows (outputs) and row-parallel layers split columns (inputs)."""
    import matplotlib.pyplot as plt
    from minipaged.models.parallel_layers import shard_dim
    n = len(shards)
    p = f"model.layers.{layer}."
    names = {"q": p + "self_attn.q_proj.weight", "k": p + "self_attn.k_proj.weight",
             "v": p + "self_attn.v_proj.weight", "o": p + "self_attn.o_proj.weight",
             "gate": p + "mlp.gate_proj.weight", "up": p + "mlp.up_proj.weight",
             "down": p + "mlp.down_proj.weight", "embed": "model.embed_tokens.weight"}
    vmax = max(float(full[v].abs().quantile(0.99)) for v in names.values())
    h, i, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    fig = plt.figure(figsize=(14, 9.2))
    gs = fig.add_gridspec(2, 7, height_ratios=[i, max(h, 1) * 1.15],
                          width_ratios=[h, h, h, h, h, h * 0.25, h * 1.6], hspace=0.35,
                          wspace=0.25)
    top = [("q", "q_proj: query heads"), ("k", "k_proj: KV heads"), ("v", "v_proj: KV heads"),
           ("gate", "gate_proj: MLP columns"), ("up", "up_proj: MLP columns")]
    axes = []
    for col, (key, what) in enumerate(top):
        ax = fig.add_subplot(gs[0, col], sharey=axes[0] if axes else None)
        name = names[key]
        unit = {"q": (d, "q heads"), "k": (d, "KV heads"), "v": (d, "KV heads")}.get(key)
        _draw_matrix(ax, name, shards, shard_dim(name), vmax, unit=unit)
        ax.set_ylim(i, 0)
        ax.set_title(f"{what}\n{tuple(full[name].shape)}  column-parallel", fontsize=9)
        ax.set_xlabel("in: hidden", fontsize=8)
        axes.append(ax)
    axes[0].set_ylabel("out (rows)", fontsize=8)
    sub = gs[1, 0:5].subgridspec(1, 2, width_ratios=[cfg.num_attention_heads * d, i], wspace=0.15)
    for col, (key, what, unit, xl) in enumerate(
            [("o", "o_proj: input = the attention heads' outputs", (d, "q heads"),
              "in: heads x head_dim"),
             ("down", "down_proj: input = the MLP columns", None, "in: MLP columns")]):
        ax = fig.add_subplot(sub[0, col])
        name = names[key]
        _draw_matrix(ax, name, shards, shard_dim(name), vmax, unit=unit)
        ax.set_ylim(h, 0)
        ax.set_aspect("equal")
        ax.set_title(f"{what}\n{tuple(full[name].shape)}  row-parallel: partial sums, "
                     f"then an all-reduce", fontsize=9)
        ax.set_xlabel(xl, fontsize=8)
        ax.set_ylabel("out: hidden", fontsize=8)
    ax = fig.add_subplot(gs[:, 6])
    name = names["embed"]
    _draw_matrix(ax, name, shards, shard_dim(name), vmax, unit=(1, "words"))
    ax.set_ylim(full[name].shape[0], 0)
    ax.set_aspect("auto")
    tied = " (tied: also the LM head)" if cfg.tie_word_embeddings else ""
    ax.set_title(f"embed_tokens{tied}\n{tuple(full[name].shape)}  vocab-parallel\n"
                 f"(drawn at a smaller scale)", fontsize=9)
    ax.set_ylabel("word id", fontsize=8)
    ax.set_xlabel("hidden", fontsize=8)
    fig.suptitle(f"Layer {layer} and the embedding, split over {n} ranks: each framed part is "
                 f"drawn from that rank's shard tensor, as its loader read it (lines: head "
                 f"boundaries; colours: the weights' values)", fontsize=11)
    return fig


# --- one layer's data flow ----------------------------------------------------------------------
def plot_layer_dataflow(cfg, world_size: int = 2, num_tokens: int = 32,
                        name: str = "stories260K"):
    """One decoder layer on `world_size` ranks, left to right: which shapes each rank computes
    (this model's numbers, `num_tokens` tokens in the step) and where the two all-reduces sit."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import FancyBboxPatch
    n, t = world_size, num_tokens
    h, d = cfg.hidden_size, cfg.head_dim
    qh, kvh = cfg.num_attention_heads // n, cfg.num_key_value_heads // n
    inter = cfg.intermediate_size // n
    stages = [  # (label, per-rank detail or None = all-reduce)
        ("hidden\n(whole)", f"({t}, {h})"),
        ("RMSNorm\n(replicated)", f"({t}, {h})"),
        ("qkv_proj\ncolumn-par.", "q {qh}, k {kvh}, v {kvh}\nheads ({t}, {w})".format(
            qh=qh, kvh=kvh, t=t, w=(qh + 2 * kvh) * d)),
        ("RoPE, K/V\n-> own cache", "KV heads\n{heads}"),
        ("attention\nown heads", f"({t}, {qh * d})"),
        ("o_proj\nrow-par.", f"partial sum\n({t}, {h})"),
        ("ALL-REDUCE\n#1", None),
        ("+ residual\nRMSNorm", f"({t}, {h})"),
        ("gate_up\ncolumn-par.", f"2 x {inter} cols\n({t}, {2 * inter})"),
        ("SiLU x up", f"({t}, {inter})"),
        ("down_proj\nrow-par.", f"partial sum\n({t}, {h})"),
        ("ALL-REDUCE\n#2", None),
        ("+ residual\n-> next layer", f"({t}, {h})"),
    ]
    row_h, gap = 1.1, 0.5
    fig_h = 1.8 + n * (row_h + gap)
    fig, ax = plt.subplots(figsize=(16, fig_h))
    width, step = 1.0, 1.16
    ys = [(n - 1 - r) * (row_h + gap) for r in range(n)]
    for j, (label, detail) in enumerate(stages):
        x = j * step
        if detail is None:  # spans every rank
            y0, y1 = ys[-1], ys[0] + row_h
            ax.add_patch(FancyBboxPatch((x, y0), width, y1 - y0, boxstyle="round,pad=0.02",
                                        facecolor=ALL_REDUCE_COLOR, alpha=0.85, edgecolor="black"))
            ax.text(x + width / 2, (y0 + y1) / 2,
                    f"{label}\nsum of {n}\n({t}, {h})\n{t * h * 4:,} B\nfp32", ha="center",
                    va="center", fontsize=7, color="white", fontweight="bold")
            continue
        for r, y in enumerate(ys):
            heads = ", ".join(str(k) for k in range(r * kvh, (r + 1) * kvh))
            replicated = "replicated" in label or "whole" in label or "residual" in label
            color = "#dddddd" if replicated else RANK_COLORS[r % len(RANK_COLORS)]
            ax.add_patch(FancyBboxPatch((x, y), width, row_h, boxstyle="round,pad=0.02",
                                        facecolor=color, alpha=0.35 if not replicated else 0.8,
                                        edgecolor="black", lw=0.8))
            ax.text(x + width / 2, y + row_h * 0.68, label, ha="center", va="center", fontsize=7,
                    fontweight="bold")
            ax.text(x + width / 2, y + row_h * 0.25, detail.format(heads=heads), ha="center",
                    va="center", fontsize=6.5)
    for j in range(len(stages) - 1):
        for y in ys:
            ax.annotate("", xy=((j + 1) * step, y + row_h / 2),
                        xytext=(j * step + width, y + row_h / 2),
                        arrowprops=dict(arrowstyle="->", lw=0.8))
    for r, y in enumerate(ys):
        ax.text(-0.15, y + row_h / 2, f"rank {r}", ha="right", va="center", fontsize=10,
                color=RANK_COLORS[r % len(RANK_COLORS)], fontweight="bold")
    ax.set_xlim(-1.0, len(stages) * step)
    ax.set_ylim(-0.75, ys[0] + row_h + 0.3)
    ax.axis("off")
    ax.text(-1.0, -0.5, f"Around the {cfg.num_hidden_layers} layers, once per step: the step's "
            f"inputs are broadcast from rank 0, embed_tokens (vocab-parallel) ends in one more "
            f"all-reduce, and the LM head's\n{cfg.vocab_size // n}-word slices of the logits are "
            f"gathered to rank 0, which samples. Grey: every rank computes the same, whole "
            f"tensor.", fontsize=8.5, va="center")
    ax.set_title(f"One decoder layer of {name} on {n} ranks, a step of {t} tokens: no "
                 f"communication until each row-parallel layer's partial sums (red: the layer's "
                 f"two all-reduces)", fontsize=10)
    return fig


def plot_kv_block(full_block: torch.Tensor, rank0_block: torch.Tensor, cfg, world_size: int,
                  title: str = ""):
    """One block of one layer's K cache, (block_size, kv_heads, head_dim): the single-device
    engine's, and rank 0's of the N-rank engine, each drawn from its own tensor; the query
    heads that read each KV head are named above it (grouped-query attention)."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle
    bs, kvh, d = full_block.shape
    per = kvh // world_size
    group = cfg.num_attention_heads // cfg.num_key_value_heads
    vmax = float(full_block.abs().max()) or 1.0
    fig, axes = plt.subplots(1, 2, figsize=(13, 3.6), gridspec_kw={"width_ratios": [kvh, per]})
    for ax, block, heads, label in ((axes[0], full_block, range(kvh), "tensor_parallel_size=1"),
                                    (axes[1], rank0_block, range(per),
                                     f"tensor_parallel_size={world_size}: rank 0's cache")):
        ax.imshow(block.reshape(bs, -1).float().numpy(), cmap="RdBu_r", vmin=-vmax, vmax=vmax,
                  aspect="auto", interpolation="nearest", extent=(0, len(heads) * d, bs, 0))
        for k in heads:
            owner = k // per
            ax.add_patch(Rectangle((k * d, 0), d, bs, fill=False, lw=2.5,
                                   edgecolor=RANK_COLORS[owner % len(RANK_COLORS)]))
            qs = ", ".join(str(q) for q in range(k * group, (k + 1) * group))
            ax.text(k * d + d / 2, -0.6, f"KV head {k} (rank {owner})\nread by q heads {qs}",
                    ha="center", va="bottom", fontsize=7.5)
        ax.set_xlabel("KV head x head_dim", fontsize=8)
        ax.set_ylabel("slot in the block", fontsize=8)
        ax.set_title(label, fontsize=9, pad=30)
        ax.set_xticks([k * d for k in heads])
    fig.suptitle(title, fontsize=10, y=1.04)
    fig.tight_layout()
    return fig


# --- what one step sends ------------------------------------------------------------------------
@dataclass
class Message:
    """One collective of a step, on every rank."""

    what: str
    op: str  # broadcast | all_reduce | gather
    shape: tuple
    dtype: torch.dtype
    count: int = 1
    group: str = "device"  # the process group it goes through (parallel_state.py)

    @property
    def bytes(self) -> int:
        """One message's size: the tensor a rank contributes (gather: one rank's part)."""
        numel = 1
        for s in self.shape:
            numel *= s
        return numel * torch.tensor([], dtype=self.dtype).element_size()


def step_messages(cfg, num_seqs: int, world_size: int = 2, query_len: int = 1,
                  dtype: torch.dtype = torch.float32, table_width: Optional[int] = None,
                  ) -> list[Message]:
    """The collectives of one engine step of `num_seqs` sequences with `query_len` new tokens
    each, in the order they run: the step's inputs (header + payload, step_inputs.py), the
    embedding's all-reduce, two per layer, the LM head's gather to rank 0."""
    from minipaged.distributed.step_inputs import HEADER_LEN
    t = num_seqs * query_len
    width = table_width if table_width is not None else 1
    payload = 3 * t + num_seqs * width + num_seqs + (num_seqs + 1) + num_seqs  # int64
    return [
        Message("step header", "broadcast", (HEADER_LEN,), torch.int64, group="cpu"),
        Message("step inputs (ids, positions, slots, block tables, ...)", "broadcast",
                (payload,), torch.int64),
        Message("embed_tokens (vocab-parallel)", "all_reduce", (t, cfg.hidden_size), dtype),
        Message("o_proj and down_proj, every layer", "all_reduce", (t, cfg.hidden_size), dtype,
                count=2 * cfg.num_hidden_layers),
        Message("lm_head logits to rank 0", "gather", (num_seqs, cfg.vocab_size // world_size),
                dtype),
    ]


def collective_counts(messages: Sequence[Message]) -> dict:
    """{"op [shape]": count} for the model's collectives (not the step's broadcasts), in the
    form `measure` counts them in the real forward (StepSplit.collectives)."""
    counts: dict = {}
    for m in messages:
        if m.op != "broadcast":
            key = f"{m.op} {list(m.shape)}"
            counts[key] = counts.get(key, 0) + m.count
    return counts


# --- pictures of the measurements ---------------------------------------------------------------
@dataclass
class StepSplit:
    """One decode step of one model at one N, best of `repeats` each (seconds): what
    tp_measure.measure returns and plot_step_split draws.

    step_s:    the engine's step (rank 0's TPDriverRunner.execute; ModelRunner at N=1)
    comm_s:    the same collectives, in the same order and sizes, with nothing else running
    compute_s: the same forward with its collectives skipped, all ranks at once (the slowest)
    compute_cpu_s: the CPU time of that forward (its thread's, the busiest rank's): the work
               one rank does, whether or not it had a core to itself meanwhile
    """

    model: str
    world_size: int
    num_seqs: int
    step_s: float
    comm_s: float
    compute_s: float
    compute_cpu_s: float = 0.0
    collectives: dict = field(default_factory=dict)  # counted in the real forward on rank 0
    params_per_rank: int = 0


def plot_step_split(splits: Sequence[StepSplit], cores: Optional[int] = None):
    """One row per (model, N), stacked: the compute's CPU time on the busiest rank (its work),
    the wall time the compute alone took beyond that (hatched: the rank waited for a core),
    then the step's collectives alone (red). The black bar is the step as the engine ran it."""
    import matplotlib.pyplot as plt
    models = list(dict.fromkeys(s.model for s in splits))
    fig, axes = plt.subplots(1, len(models), figsize=(13, 1.2 + 0.8 * len(splits) / len(models)))
    axes = [axes] if len(models) == 1 else list(axes)
    for ax, model in zip(axes, models):
        rows = [s for s in splits if s.model == model]
        for k, s in enumerate(rows):
            cpu, wait = s.compute_cpu_s * 1e3, max(0.0, s.compute_s - s.compute_cpu_s) * 1e3
            first = k == 0
            ax.barh(k, cpu, color="#7f7f7f", label="compute: CPU time per rank" if first else None)
            ax.barh(k, wait, left=cpu, color="white", edgecolor="#7f7f7f", hatch="///",
                    label="compute: waiting for a core" if first else None)
            ax.barh(k, s.comm_s * 1e3, left=cpu + wait, color=ALL_REDUCE_COLOR,
                    label="communication alone" if first else None)
            ax.plot([s.step_s * 1e3] * 2, [k - 0.45, k + 0.45], color="black", lw=3,
                    label="the step, as the engine ran it" if first else None)
            ax.text(max(s.step_s, s.compute_s + s.comm_s) * 1e3 * 1.02, k,
                    f"{s.step_s * 1e3:.1f} ms", va="center", fontsize=8)
        ax.set_yticks(range(len(rows)))
        ax.set_yticklabels([f"N={s.world_size}" + (f"\n({s.world_size} ranks,\n{cores} cores)"
                                                   if cores and s.world_size > cores else "")
                            for s in rows], fontsize=8)
        ax.invert_yaxis()
        right = max(max(s.step_s, s.compute_s + s.comm_s) for s in rows) * 1e3
        ax.set_xlim(0, right * 1.22)
        ax.set_xlabel("ms per decode step (best of the repeats)")
        ax.set_title(f"{model}: a decode step of {rows[0].num_seqs} sequences", fontsize=10)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, fontsize=8, loc="lower center", ncol=4, frameon=False)
    fig.tight_layout(rect=(0, 0.1, 1, 1))
    return fig


def plot_all_reduce(times: dict, marks: dict, title: str = ""):
    """Time of one gloo all-reduce against its size, one line per N; `marks` names sizes of
    interest (a step's messages)."""
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(8, 3.8))
    for k, (n, curve) in enumerate(sorted(times.items())):
        xs = sorted(curve)
        ax.loglog(xs, [curve[x] * 1e6 for x in xs], "o-", color=RANK_COLORS[(k + 1) % 4],
                  label=f"N={n}")
    for label, size in marks.items():
        ax.axvline(size, color="gray", ls=":", lw=1)
        ax.text(size, ax.get_ylim()[1], label, rotation=90, va="top", ha="right", fontsize=7.5)
    ax.set_xlabel("bytes per rank (float32 tensor)")
    ax.set_ylabel("µs per all-reduce (best)")
    ax.set_title(title, fontsize=10)
    ax.legend()
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    return fig
