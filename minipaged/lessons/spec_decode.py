"""Lesson 10 (speculative decoding): the distribution check, acceptance replays and the pictures.

What notebooks/10_speculative_decoding.ipynb imports, beside the engine itself:

* `distribution_check` runs `rejection_sample` (minipaged/sampling/rejection_sampler.py) on many
  independent rows of one toy pair (p, q) and counts the first emitted token, next to rules that
  are nearly right; `chi_square_p_value` says whether counts follow p; `plot_distribution_check`.
* `replay_greedy` replays a greedy output with a proposer: under greedy decoding a guess is kept
  exactly when it equals the token the target produced, so the output alone says what every
  verify step would accept (`acceptance_rows`, `plot_acceptance`). The engine's own counts
  (RequestOutput.metrics) are checked against it in tests/test_lessons_spec_decode.py.
* `plot_spec_step` draws one step on a sequence's block table: the proposal written into slots,
  the verify step's verdict, and the rollback that gives the rejected slots back.

The timing runs (one stream vs a full batch) are in `spec_decode_measure.py`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

import matplotlib.pyplot as plt
import torch
from matplotlib.patches import Patch, Rectangle

from minipaged.lessons.viz.common import FREE_COLOR
from minipaged.sampling.rejection_sampler import rejection_sample

RULES = {
    "rejection": "minipaged: accept min(1, p/q), else from max(0, p - q)",
    "accept_all": "biased: keep every guess",
    "resample_p": "biased: accept min(1, p/q), else from p",
}
CACHED_COLOR = "#9ecae1"  # K/V already in the cache
PROPOSED_COLOR = "#fdae61"  # written this step, not yet judged
ACCEPTED_COLOR = "#31a354"
REJECTED_COLOR = "#e31a1c"
BONUS_COLOR = "#756bb1"  # the token the verify step adds (its K/V is written next step)


# --- 1. the rule keeps p ------------------------------------------------------------------
def toy_pair() -> tuple[torch.Tensor, torch.Tensor]:
    """A target p and a proposer q over 8 tokens that disagree (q misses token 7 entirely)."""
    p = torch.tensor([0.05, 0.20, 0.05, 0.10, 0.25, 0.05, 0.10, 0.20])
    q = torch.tensor([0.30, 0.10, 0.15, 0.05, 0.20, 0.15, 0.05, 0.00])
    return p, q


def chi_square_p_value(tokens: torch.Tensor, probs: torch.Tensor) -> float:
    """P-value of the counts of `tokens` against `probs` (vocab,) on p's support; 0 when a token
    outside the support appears."""
    counts = torch.bincount(tokens, minlength=len(probs)).double()
    support = probs > 0
    if counts[~support].sum() > 0:
        return 0.0
    expected = probs.double()[support] * counts.sum()
    stat = ((counts[support] - expected) ** 2 / expected).sum()
    dof = torch.tensor((int(support.sum()) - 1) / 2, dtype=torch.float64)
    return float(torch.special.gammaincc(dof, stat / 2))


@dataclass
class DistributionCheck:
    rule: str
    frequencies: torch.Tensor  # (vocab,) share of rows whose first emitted token is each id
    acceptance: float  # share of guesses kept
    p_value: float  # chi-square against p


def distribution_check(p: torch.Tensor, q: Optional[torch.Tensor], rule: str = "rejection",
                       rows: int = 20_000, seed: int = 0) -> DistributionCheck:
    """One guess per row (drawn from q; q None: a uniform guess verified as an n-gram guess, q
    one-hot), verified against p by `rule`; the first emitted token of each row counted."""
    if rule not in RULES:
        raise ValueError(f"rule must be one of {sorted(RULES)}, got {rule!r}")
    gen = torch.Generator().manual_seed(seed)
    vocab = len(p)
    guess_dist = torch.full((vocab,), 1.0 / vocab) if q is None else q
    drafts = torch.multinomial(guess_dist, rows, replacement=True, generator=gen)[:, None]
    draft_probs = None if q is None else q.expand(rows, 1, vocab)
    out, accepted = rejection_sample(p.expand(rows, 2, vocab), drafts,
                                     torch.ones(rows, dtype=torch.long), draft_probs,
                                     generator=gen)
    first = out[:, 0]
    if rule == "accept_all":
        first, accepted = drafts[:, 0], torch.ones(rows, dtype=torch.long)
    elif rule == "resample_p":  # the right acceptances, the correction drawn from p itself
        from_p = torch.multinomial(p, rows, replacement=True, generator=gen)
        first = torch.where(accepted == 1, drafts[:, 0], from_p)
    freqs = torch.bincount(first, minlength=vocab).double() / rows
    return DistributionCheck(rule, freqs, accepted.double().mean().item(),
                             chi_square_p_value(first, p))


def plot_distribution_check(p: torch.Tensor, q: Optional[torch.Tensor],
                            checks: Sequence[DistributionCheck], rows: int):
    """Bars per token: p, q, and each rule's measured frequencies (title: their p-values)."""
    vocab = len(p)
    series = [("target p", p.double(), "0.2")]
    if q is not None:
        series.append(("proposer q", q.double(), "0.75"))
    colours = {"rejection": ACCEPTED_COLOR, "accept_all": REJECTED_COLOR,
               "resample_p": PROPOSED_COLOR}
    series += [(f"{RULES[c.rule]} (chi-square p = {c.p_value:.2g})", c.frequencies,
                colours[c.rule]) for c in checks]
    fig, ax = plt.subplots(figsize=(11, 3.4))
    width = 0.8 / len(series)
    for i, (label, values, colour) in enumerate(series):
        ax.bar(torch.arange(vocab) + (i - (len(series) - 1) / 2) * width, values.tolist(),
               width, label=label, color=colour)
    ax.set_xticks(range(vocab), [f"token {t}" for t in range(vocab)], fontsize=8)
    ax.set_ylabel("probability / frequency")
    ax.set_title(f"first emitted token over {rows:,} rows", fontsize=10)
    ax.legend(fontsize=7, frameon=False, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    return fig


# --- 2. acceptance, replayed from a greedy output --------------------------------------------
@dataclass
class Replay:
    """What speculative greedy decoding does to one output: one entry per verify step."""

    k: int
    proposed: list[int] = field(default_factory=list)  # guesses made at each step
    accepted: list[int] = field(default_factory=list)  # of them kept

    @property
    def num_steps(self) -> int:
        return len(self.accepted)

    @property
    def num_tokens(self) -> int:
        return sum(self.accepted) + self.num_steps  # each step adds its kept guesses + one

    def accepted_at(self, position: int) -> tuple[int, int]:
        """(steps that guessed at `position` (0-based), steps that kept that guess)."""
        tried = sum(n > position for n in self.proposed)
        kept = sum(a > position for a in self.accepted)
        return tried, kept


def replay_greedy(proposer, prompt_token_ids: Sequence[int],
                  output_token_ids: Sequence[int]) -> Replay:
    """Step through `output_token_ids` (a greedy output) as a speculating engine would: the
    prompt's forward gives the first token without guessing; then each step proposes from the
    tokens so far, keeps the guesses that equal the output's next tokens up to the first miss,
    and adds one token from the target. Guesses never run past the output (the engine does not
    propose past max_tokens: the last token is always the target's)."""
    out = list(output_token_ids)
    tokens = list(prompt_token_ids)
    replay = Replay(k=proposer.k)
    done = 0
    while done < len(out):
        guess = proposer.propose(tokens)[:len(out) - done - 1] if done else []
        kept = 0
        while kept < len(guess) and guess[kept] == out[done + kept]:
            kept += 1
        replay.proposed.append(len(guess))
        replay.accepted.append(kept)
        tokens += out[done:done + kept + 1]
        done += kept + 1
    return replay


def acceptance_rows(replays: Sequence[Replay]) -> dict:
    """Totals over several replays with the same k: steps, tokens per step, acceptance rate
    (kept / proposed) and the acceptance at each position."""
    steps = sum(r.num_steps for r in replays)
    tokens = sum(r.num_tokens for r in replays)
    proposed = sum(sum(r.proposed) for r in replays)
    accepted = sum(sum(r.accepted) for r in replays)
    k = replays[0].k
    per_position = []
    for i in range(k):
        tried = sum(r.accepted_at(i)[0] for r in replays)
        kept = sum(r.accepted_at(i)[1] for r in replays)
        per_position.append(kept / tried if tried else 0.0)
    return {"k": k, "steps": steps, "tokens": tokens, "tokens_per_step": tokens / steps,
            "proposed": proposed, "accepted": accepted,
            "acceptance_rate": accepted / proposed if proposed else 0.0,
            "acceptance_per_position": per_position}


def engine_rows(llm, outputs, first_step: int = 0, trace=None) -> dict:
    """`acceptance_rows`'s numbers from an engine run instead of a replay: its requests'
    metrics, the forwards that computed each request, and the acceptance per position the
    trace records (`trace`: the run's records; default the engine's from `first_step`)."""
    trace = llm.engine.trace[first_step:] if trace is None else trace
    ids = {o.request_id for o in outputs}
    steps = sum(e.request_id in ids for r in trace for e in r.scheduled)
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    proposed = sum(o.metrics["spec_num_draft_tokens"] for o in outputs)
    accepted = sum(o.metrics["spec_num_accepted_tokens"] for o in outputs)
    k = llm.engine.config.speculative.num_speculative_tokens
    drafts = [sum(r.num_draft_tokens_per_pos[i] for r in trace if r.num_draft_tokens_per_pos)
              for i in range(k)]
    hits = [sum(r.num_accepted_tokens_per_pos[i] for r in trace if r.num_accepted_tokens_per_pos)
            for i in range(k)]
    return {"k": k, "steps": steps, "tokens": tokens, "tokens_per_step": tokens / steps,
            "proposed": proposed, "accepted": accepted,
            "acceptance_rate": accepted / proposed if proposed else 0.0,
            "acceptance_per_position": [h / d if d else 0.0 for h, d in zip(hits, drafts)]}


def tokens_per_forward_along_text(replays: Sequence[Replay], bucket: int = 64) -> list[float]:
    """Tokens per target forward of the steps that started while the output was at tokens
    [0, bucket), [bucket, 2 bucket), ...: does the text get easier to guess as it goes on?"""
    forwards: dict[int, int] = {}
    tokens: dict[int, int] = {}
    for r in replays:
        position = 0
        for a in r.accepted:
            b = position // bucket
            forwards[b] = forwards.get(b, 0) + 1
            tokens[b] = tokens.get(b, 0) + a + 1
            position += a + 1
    return [tokens[b] / forwards[b] for b in sorted(forwards)]


def plot_acceptance(rows_by_text: dict[str, Sequence[dict]]):
    """Left: tokens per target forward against k, one line per text. Right: at each guess
    position of a step, the share of steps guessing there that kept it, for the largest k (a
    guess is kept only if every guess before it in the step was: vLLM's acceptance per
    position)."""
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.4))
    for text, rows in rows_by_text.items():
        ks = [r["k"] for r in rows]
        ax1.plot(ks, [r["tokens_per_step"] for r in rows], marker="o", label=text)
        last = rows[-1]
        ax2.plot(range(1, last["k"] + 1), last["acceptance_per_position"], marker="o",
                 label=f"{text} (k={last['k']})")
    ax1.axhline(1.0, color="0.6", linewidth=0.8, linestyle="--")
    ax1.set_xlabel("k (num_speculative_tokens)")
    ax1.set_ylabel("tokens per target forward")
    ax1.set_title("what a verify step yields", fontsize=10)
    ax2.set_xlabel("guess position in the step")
    ax2.set_ylabel("share of steps that kept it")
    ax2.set_ylim(0, 1)
    ax2.set_title("acceptance per position", fontsize=10)
    for ax in (ax1, ax2):
        ax.legend(fontsize=7, frameon=False)
    fig.tight_layout()
    return fig


# --- 3. one step on the block table -------------------------------------------------------
@dataclass
class SpecStep:
    """One verify step of one sequence, as the engine ran it."""

    step: int  # the engine step's index
    token_ids: list[int]  # the sequence before the step (its last token is pending)
    num_computed: int  # tokens with K/V in the cache before the step
    proposal: list[int]
    block_table: list[int]  # during the step (covers the proposals' slots)
    block_table_after: list[int]  # after the rollback
    num_accepted: int
    new_token: int  # the correction or bonus token the step added
    finished: bool  # the request ended with this step (its blocks all went back)

    @property
    def freed_blocks(self) -> list[int]:
        return [b for b in self.block_table if b not in self.block_table_after]


def record_spec_steps(llm, prompt, params) -> list[SpecStep]:
    """Run one request alone on `llm` (which speculates) and record each of its verify steps:
    the proposal and block table when the forward ran (read from the scheduler's output the
    model runner receives), and what the rollback left."""
    eng = llm.engine
    bm = eng.block_manager
    seq = eng.add_request("spec-step", prompt, params)
    seen: dict = {}
    real_execute = eng.model_runner.execute

    def execute(sched):
        for s in sched.scheduled:
            if s.seq is seq and s.spec_token_ids:
                seen["proposal"] = list(s.spec_token_ids)
                seen["table"] = list(bm.block_tables[seq.seq_id])
        return real_execute(sched)

    steps = []
    eng.model_runner.execute = execute
    try:
        while not seq.is_finished:
            before = (list(seq.token_ids), seq.num_computed_tokens)
            seen.clear()
            eng.step()
            if "proposal" not in seen:
                continue
            tokens, computed = before
            kept = len(seq.token_ids) - len(tokens) - 1  # a step adds kept guesses + one token
            steps.append(SpecStep(len(eng.trace) - 1, tokens, computed, seen["proposal"],
                                  seen["table"], list(bm.block_tables.get(seq.seq_id, [])),
                                  kept, seq.token_ids[len(tokens) + kept], seq.is_finished))
    finally:
        eng.model_runner.execute = real_execute
    return steps


def plot_engine_spec_step(step: SpecStep, block_size: int, tokenizer=None):
    """`plot_spec_step` for a recorded step, tokens shown as the tokenizer's pieces."""
    def label(t: int) -> str:
        return tokenizer.convert_ids_to_tokens(t).replace("▁", "_") if tokenizer else str(t)
    return plot_spec_step(step.block_table, block_size, step.num_computed,
                          [label(t) for t in step.proposal], step.num_accepted,
                          label(step.token_ids[-1]), label(step.new_token), step.freed_blocks,
                          [label(t) for t in step.token_ids[:step.num_computed]])


def plot_spec_step(block_table: Sequence[int], block_size: int, num_computed: int,
                   proposal: Sequence[str], num_accepted: int, pending: str, bonus: str,
                   freed_blocks: Sequence[int] = (), context: Sequence[str] = ()):
    """One speculative step of one sequence, drawn on its block table in three rows.

    block_table: the physical blocks during the step (they cover num_computed + 1 + k slots);
    num_computed: tokens whose K/V were in the cache before the step; pending: the last sampled
    token (its K/V is written by this step); proposal: the k guesses; num_accepted: how many the
    verify step kept; bonus: the token it added; freed_blocks: the blocks the rollback gave
    back; context: labels of the cached tokens (the last ones are shown).

    1. propose: the pending token and the k guesses are written into slots after the cache.
    2. verify: the target's forward scores all k + 1 at once; guesses are kept up to the first
       rejection, and one token (correction or bonus) is added.
    3. rollback: num_computed_tokens drops to the kept ones; rejected slots are free again, and
       a block left empty returns to the free queue.
    """
    k = len(proposal)
    num_slots = len(block_table) * block_size
    if num_computed + 1 + k > num_slots:
        raise ValueError(f"block_table holds {num_slots} slots, the step needs "
                         f"num_computed + 1 + k = {num_computed + 1 + k}")
    first_block = max(0, num_computed // block_size - 1)  # draw from the block before the step
    shown = list(range(first_block, len(block_table)))
    labels = list(context)[-num_computed:] if context else []
    labels = [""] * (num_computed - len(labels)) + labels
    rows = ("1. propose: write the pending token + k guesses",
            "2. verify: one forward scores k + 1 positions",
            "3. rollback: rejected slots given back")
    fig, axes = plt.subplots(3, 1, figsize=(1.1 + 0.55 * block_size * len(shown), 4.8))
    kept_end = num_computed + 1 + num_accepted  # slots [0, kept_end) hold kept K/V
    for row, ax in enumerate(axes):
        for bi, logical in enumerate(shown):
            freed = row == 2 and block_table[logical] in freed_blocks
            x0 = bi * block_size
            ax.add_patch(Rectangle((x0 - 0.05, -0.15), block_size + 0.1 - 0.1, 1.3, fill=False,
                                   edgecolor="0.6" if freed else "0.2",
                                   linestyle="--" if freed else "-", linewidth=1.2))
            ax.text(x0 + block_size / 2, 1.3, f"block {block_table[logical]}"
                    + (" → free queue" if freed else ""), ha="center", va="bottom", fontsize=7,
                    color=REJECTED_COLOR if freed else "0.2")
            for off in range(block_size):
                slot = logical * block_size + off
                colour, text, hatch = _slot(slot, row, num_computed, k, num_accepted, kept_end,
                                            labels, pending, proposal)
                ax.add_patch(Rectangle((x0 + off, 0), 0.9, 1, facecolor=colour,
                                       edgecolor="0.5", hatch=hatch, linewidth=0.6))
                ax.text(x0 + off + 0.45, 0.5, text, ha="center", va="center", fontsize=7,
                        rotation=90 if len(text) > 3 else 0,
                        color="white" if colour in (ACCEPTED_COLOR, REJECTED_COLOR) else "black",
                        bbox=dict(facecolor=colour, edgecolor="none", pad=0.5) if hatch else None)
        if row >= 1:  # the token the step adds: in no slot yet
            x = len(shown) * block_size + 0.4
            ax.add_patch(Rectangle((x, 0), 0.9, 1, facecolor=BONUS_COLOR, edgecolor="0.5"))
            ax.text(x + 0.45, 0.5, bonus, ha="center", va="center", fontsize=7, color="white",
                    rotation=90 if len(bonus) > 3 else 0)
            ax.text(x + 1.1, 0.5, "new token\n(K/V next step)", va="center", fontsize=7)
        ax.set_xlim(-0.3, len(shown) * block_size + 4.5)
        ax.set_ylim(-0.3, 1.8)
        ax.axis("off")
        ax.set_title(rows[row], fontsize=9, loc="left")
    handles = [Patch(facecolor=CACHED_COLOR, label="K/V in the cache"),
               Patch(facecolor=PROPOSED_COLOR, label="written this step"),
               Patch(facecolor=ACCEPTED_COLOR, label="kept"),
               Patch(facecolor=REJECTED_COLOR, hatch="xx", label="rejected"),
               Patch(facecolor=BONUS_COLOR, label="correction / bonus"),
               Patch(facecolor=FREE_COLOR, edgecolor="0.5", label="free slot")]
    fig.legend(handles=handles, loc="lower center", ncol=6, fontsize=7, frameon=False)
    fig.suptitle(f"one speculative step: k = {k}, {num_accepted} kept, "
                 f"{num_accepted + 1} tokens for one target forward", fontsize=10)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    return fig


def _slot(slot, row, num_computed, k, num_accepted, kept_end, labels, pending, proposal):
    """(colour, label, hatch) of one slot in row 0 (propose), 1 (verify) or 2 (rollback)."""
    if slot < num_computed:
        return CACHED_COLOR, labels[slot], None
    step_slot = slot - num_computed  # 0: the pending token, 1..k: the guesses
    if step_slot > k:
        return FREE_COLOR, "", None
    text = pending if step_slot == 0 else proposal[step_slot - 1]
    if row == 0:
        return PROPOSED_COLOR, text, None
    if slot < kept_end:
        return (ACCEPTED_COLOR if row == 1 else CACHED_COLOR), text, None
    if row == 1:
        return REJECTED_COLOR, text, "xx"
    return FREE_COLOR, "", None
