"""How long a step takes, as a function of what it computes (lesson 13's virtual clock).

A step's time is modelled as a sum of costs the scheduler's plan already knows:

    seconds = c_step                                 the fixed cost (launches, Python, sampling)
            + c_prefill   * (1 if any prefill)       a prefill's own path (varlen metadata, its
                                                     attention calls)
            + c_seq       * sequences in the step    per-row work (inputs, sampler, outputs)
            + c_token     * tokens in the step       the linear layers (prefill and decode alike)
            + c_ctx       * decode context tokens    attention reading each decode's K/V
            + c_attn      * prefill attention        each chunk's queries x its context

(`step_features`; "prefill attention" is the sum over prefill chunks of n x (cached + n), in
thousands). The coefficients are fitted by non-negative least squares to the steps of a real
engine's trace (`fit`: `StepRecord.duration` against the same features read back from
`StepRecord.scheduled`), so the model speaks for the machine and the model it was measured on;
`to_dict` / `from_dict` keep it in a JSON. A negative cost means nothing physical, so a feature
whose best coefficient is negative is dropped and the rest refitted (Lawson and Hanson's idea,
one feature at a time).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Optional

import numpy as np

FEATURES = ("step", "prefill_step", "seqs", "tokens", "decode_context", "prefill_attention")


def features(entries: Iterable[tuple[int, int, int]]) -> np.ndarray:
    """The feature vector of a step from (prefill tokens, decode tokens, tokens cached before)
    of each scheduled sequence."""
    f = np.zeros(len(FEATURES))
    f[0] = 1.0
    for prefill, decode, before in entries:
        f[2] += 1
        f[3] += prefill + decode
        if decode:
            f[4] += before + decode
        if prefill:
            f[1] = 1.0
            f[5] += prefill * (before + prefill) / 1000.0
    return f


def step_features(sched) -> np.ndarray:
    """Features of a planned step (a `SchedulerOutput`, before its tokens are computed)."""
    return features((s.num_new_tokens if s.is_prefill else 0,
                     0 if s.is_prefill else s.num_new_tokens, s.seq.num_computed_tokens)
                    for s in sched.scheduled)


def record_features(record) -> np.ndarray:
    """Features of a recorded step (a `StepRecord`)."""
    return features((e.num_prefill_tokens, e.num_decode_tokens, e.num_computed_before)
                    for e in record.scheduled)


def nnls(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Least squares with every coefficient >= 0: drop the most negative one and refit."""
    active = list(range(a.shape[1]))
    while True:
        coef = np.zeros(a.shape[1])
        if active:
            coef[active] = np.linalg.lstsq(a[:, active], b, rcond=None)[0]
        neg = [i for i in active if coef[i] < 0]
        if not neg:
            return coef
        active.remove(min(neg, key=lambda i: coef[i]))


@dataclass
class StepCostModel:
    """Seconds per step = coefficients . features (see the docstring)."""

    coefficients: dict[str, float]
    source: str = ""  # what it was fitted on
    fit_stats: dict = field(default_factory=dict)

    def predict(self, f: np.ndarray) -> float:
        return float(sum(self.coefficients.get(k, 0.0) * v for k, v in zip(FEATURES, f)))

    def step_time(self, sched) -> float:
        """Seconds of a planned step; 0 for one that runs no forward (it only preempted)."""
        return 0.0 if sched.is_empty else self.predict(step_features(sched))

    @classmethod
    def fit(cls, records, source: str = "",
            durations: Optional[list[float]] = None) -> "StepCostModel":
        """Fit to the steps of a trace that ran a forward: their `duration`s, or `durations`
        (one per record: e.g. CPU seconds measured around each step, replay.py)."""
        records = list(records)
        secs = [r.duration for r in records] if durations is None else list(durations)
        if len(secs) != len(records):
            raise ValueError(f"{len(secs)} durations for {len(records)} steps")
        pairs = [(r, d) for r, d in zip(records, secs) if r.scheduled]
        if len(pairs) < len(FEATURES):
            raise ValueError(f"fitting {len(FEATURES)} coefficients needs at least as many "
                             f"steps, got {len(pairs)}")
        a = np.stack([record_features(r) for r, _ in pairs])
        b = np.array([d for _, d in pairs])
        coef = nnls(a, b)
        pred = a @ coef
        rel = np.abs(pred - b) / np.maximum(b, 1e-9)
        stats = {"steps": len(pairs), "mean_step_ms": float(b.mean() * 1e3),
                 "r2": float(1 - ((b - pred) ** 2).sum() / max(((b - b.mean()) ** 2).sum(), 1e-30)),
                 "median_abs_rel_error": float(np.median(rel)),
                 "total_time_ratio": float(pred.sum() / b.sum())}
        return cls(dict(zip(FEATURES, map(float, coef))), source, stats)

    def to_dict(self) -> dict:
        return {"coefficients": self.coefficients, "source": self.source,
                "fit_stats": self.fit_stats}

    @classmethod
    def from_dict(cls, d: dict) -> "StepCostModel":
        unknown = set(d["coefficients"]) - set(FEATURES)
        if unknown:
            raise ValueError(f"unknown cost-model features {sorted(unknown)}; known: {FEATURES}")
        return cls(dict(d["coefficients"]), d.get("source", ""), d.get("fit_stats", {}))

    def describe(self) -> str:
        units = {"step": "ms per step", "prefill_step": "ms more with a prefill",
                 "seqs": "us per sequence", "tokens": "us per token",
                 "decode_context": "ns per decode context token",
                 "prefill_attention": "ns per (query x context) pair"}
        scale = {"step": 1e3, "prefill_step": 1e3, "seqs": 1e6, "tokens": 1e6,
                 "decode_context": 1e9,
                 "prefill_attention": 1e6}
        return ", ".join(f"{self.coefficients[k] * scale[k]:.3g} {units[k]}" for k in FEATURES
                         if self.coefficients.get(k))


def synthetic(step_ms: float, token_us: float, seq_us: float = 0.0, ctx_ns: float = 0.0,
              attn_ns: float = 0.0, prefill_step_ms: float = 0.0,
              source: Optional[str] = None) -> StepCostModel:
    """A model from stated costs (no measurement): for tests and what-if lessons."""
    return StepCostModel({"step": step_ms / 1e3, "prefill_step": prefill_step_ms / 1e3,
                          "seqs": seq_us / 1e6, "tokens": token_us / 1e6,
                          "decode_context": ctx_ns / 1e9, "prefill_attention": attn_ns / 1e6},
                         source or "stated costs")
