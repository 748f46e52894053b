"""Prometheus metrics for `GET /metrics`, named like vLLM's (`vllm:` becomes `minipaged:`).
Lesson 07 explains it and plots them while a burst of requests runs.

    minipaged:num_requests_running        gauge      sequences in the running batch
    minipaged:num_requests_waiting        gauge      queued: no seat (max_num_seqs) or no KV blocks,
                                                     or its grammar still compiling
    minipaged:kv_cache_blocks_used        gauge      blocks referenced by live sequences
    minipaged:kv_cache_blocks_total       gauge      size of the cache in blocks
    minipaged:kv_cache_usage_perc         gauge      used / total, 0..1 (vLLM's name)
    minipaged:num_preemptions_total       counter    sequences preempted (recompute or swap)
    minipaged:prefix_cache_queries_total  counter    prompt tokens looked up in the prefix cache
    minipaged:prefix_cache_hits_total     counter    ... of which were found (hit rate = hits/queries)
    minipaged:prompt_tokens_total         counter    prompt tokens prefilled
    minipaged:generation_tokens_total     counter    tokens generated
    minipaged:request_success_total       counter    finished requests, by finished_reason
    minipaged:time_to_first_token_seconds histogram  request arrival -> first token
    minipaged:inter_token_latency_seconds histogram  gap between two tokens of one request
    minipaged:e2e_request_latency_seconds histogram  arrival -> last token
    minipaged:request_queue_time_seconds  histogram  arrival -> first scheduled (waiting)
    minipaged:request_prefill_time_seconds histogram first scheduled -> first token
    minipaged:request_decode_time_seconds histogram  first token -> last token
    minipaged:request_params_n            histogram  the n (samples per prompt) of requests
    minipaged:spec_decode_num_drafts_total           counter  speculative verify steps of one
                                                              sequence (lesson 10)
    minipaged:spec_decode_num_draft_tokens_total     counter  tokens proposed
    minipaged:spec_decode_num_accepted_tokens_total  counter  ... of which accepted
    minipaged:spec_decode_num_accepted_tokens_per_pos_total{position="i"}  counter  accepted
                                                              at proposal position i

Every `Metrics` has its own `CollectorRegistry` (not prometheus_client's global one), so a test
or a notebook can build several servers in one process. The API server process updates them from
what the engine core sends after each step (async_llm.py); `/metrics` renders the registry in
Prometheus' text format.
"""
from __future__ import annotations

from prometheus_client import (CollectorRegistry, Counter, Gauge, Histogram,
                               disable_created_metrics, generate_latest)
from prometheus_client.parser import text_string_to_metric_families

disable_created_metrics()  # no `*_created` timestamp series (vLLM turns them off too)

PREFIX = "minipaged:"
TTFT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
ITL_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4,
               0.5, 0.75, 1.0, 2.5, 5.0)
E2E_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
               40.0, 50.0, 60.0, 120.0, 240.0)


class Metrics:
    def __init__(self, model_name: str, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        r, labels = self.registry, ["model_name"]
        self.model_name = model_name

        def gauge(name, doc):
            return Gauge(PREFIX + name, doc, labels, registry=r).labels(model_name)

        def counter(name, doc):
            return Counter(PREFIX + name, doc, labels, registry=r).labels(model_name)

        def histogram(name, doc, buckets):
            return Histogram(PREFIX + name, doc, labels, buckets=buckets,
                             registry=r).labels(model_name)

        self.num_requests_running = gauge("num_requests_running", "Requests in the running batch.")
        self.num_requests_waiting = gauge("num_requests_waiting", "Requests waiting to be scheduled.")
        self.kv_cache_blocks_used = gauge("kv_cache_blocks_used", "KV-cache blocks in use.")
        self.kv_cache_blocks_total = gauge("kv_cache_blocks_total", "KV-cache blocks in total.")
        self.kv_cache_usage_perc = gauge("kv_cache_usage_perc", "KV-cache usage: 0 empty, 1 full.")
        self.num_preemptions = counter("num_preemptions", "Cumulative number of preemptions.")
        self.prompt_tokens = counter("prompt_tokens", "Number of prefilled prompt tokens.")
        self.generation_tokens = counter("generation_tokens", "Number of generated tokens.")
        self._success = Counter(PREFIX + "request_success", "Finished requests.",
                                labels + ["finished_reason"], registry=r)
        self.time_to_first_token = histogram("time_to_first_token_seconds",
                                             "Time to first token in seconds.", TTFT_BUCKETS)
        self.inter_token_latency = histogram("inter_token_latency_seconds",
                                             "Inter-token latency in seconds.", ITL_BUCKETS)
        self.e2e_request_latency = histogram("e2e_request_latency_seconds",
                                             "End-to-end request latency in seconds.", E2E_BUCKETS)
        self.request_queue_time = histogram("request_queue_time_seconds",
                                            "Time a request waited before it was first scheduled.",
                                            E2E_BUCKETS)
        self.request_prefill_time = histogram("request_prefill_time_seconds",
                                              "Time from first scheduled to the first token.",
                                              E2E_BUCKETS)
        self.request_decode_time = histogram("request_decode_time_seconds",
                                             "Time from the first token to the last.", E2E_BUCKETS)
        self.request_params_n = histogram("request_params_n", "The n parameter of requests.",
                                          (1, 2, 5, 10, 20, 50, 100))
        self.prefix_cache_queries = counter("prefix_cache_queries",
                                            "Prompt tokens looked up in the prefix cache.")
        self.prefix_cache_hits = counter("prefix_cache_hits",
                                         "Prompt tokens found in the prefix cache.")

        self.spec_decode_num_drafts = counter(
            "spec_decode_num_drafts", "Speculative verify steps of one sequence.")
        self.spec_decode_num_draft_tokens = counter(
            "spec_decode_num_draft_tokens", "Proposed (draft) tokens.")
        self.spec_decode_num_accepted_tokens = counter(
            "spec_decode_num_accepted_tokens", "Accepted proposed tokens.")
        self._spec_per_pos = Counter(PREFIX + "spec_decode_num_accepted_tokens_per_pos",
                                     "Accepted proposed tokens, by position in the proposal.",
                                     labels + ["position"], registry=r)

    def spec_decode_step(self, st, last) -> None:
        """Add what the engine's cumulative spec-decode counters gained since `last`
        (messages.EngineStats; None: the first)."""
        self.spec_decode_num_drafts.inc(st.spec_num_drafts - (last.spec_num_drafts if last else 0))
        self.spec_decode_num_draft_tokens.inc(
            st.spec_num_draft_tokens - (last.spec_num_draft_tokens if last else 0))
        self.spec_decode_num_accepted_tokens.inc(
            st.spec_num_accepted_tokens - (last.spec_num_accepted_tokens if last else 0))
        before = last.spec_num_accepted_tokens_per_pos if last else []
        for i, n in enumerate(st.spec_num_accepted_tokens_per_pos):
            gained = n - (before[i] if i < len(before) else 0)
            if gained:
                self._spec_per_pos.labels(self.model_name, str(i)).inc(gained)

    def request_finished(self, reason: str) -> None:
        self._success.labels(self.model_name, reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> {sample name: value}, summed over labels (enough for plots and tests).

    Samples with labels other than `model_name` also appear under their labelled name, e.g.
    `minipaged:request_success_total{finished_reason="abort"}`. Histograms appear as
    `<name>_count` and `<name>_sum` (use `_sum / _count` for a mean) and per-bucket
    `<name>_bucket{le="0.1"}` (cumulative counts)."""
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            values[s.name] = values.get(s.name, 0.0) + s.value
            extra = {k: v for k, v in s.labels.items() if k != "model_name"}
            if extra:
                key = s.name + "{" + ",".join(f'{k}="{v}"' for k, v in sorted(extra.items())) + "}"
                values[key] = values.get(key, 0.0) + s.value
    return values
