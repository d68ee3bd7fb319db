"""Prometheus metrics of one Serve replica: the engine's counters (read at scrape time) and latencies."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily

from runtime.engine.core import Engine

PREFIX = "dspark"
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class EngineCollector:
    """vLLM's speculative-decoding counter names under our prefix, plus load and the per-rank MoE backend."""

    def __init__(self, engine_of: Callable[[], Engine], rank_info: list[dict]):
        self.engine_of, self.rank_info = engine_of, rank_info

    def collect(self):
        engine = self.engine_of()
        m = engine.get_metrics()
        for name, doc in (("num_drafts", "Verify steps of one request that carried drafts."),
                          ("num_draft_tokens", "Draft tokens proposed to the target."),
                          ("num_accepted_tokens", "Draft tokens the target accepted.")):
            yield CounterMetricFamily(f"{PREFIX}:spec_decode_{name}", doc, value=m[name])
        for name, doc in (("prefix_cache_queries", "Prompt tokens looked up in the prefix cache (vLLM's name)."),
                          ("prefix_cache_hits", "Of those, tokens whose KV pages were found cached."),
                          ("num_aborted_requests", "Requests aborted before they finished: their client went "
                           "away (or the server stopped), their pages freed.")):
            yield CounterMetricFamily(f"{PREFIX}:{name}", doc, value=m[name])
        per_pos = CounterMetricFamily(f"{PREFIX}:spec_decode_num_accepted_tokens_per_pos",
                                      "Accepted draft tokens by position in the block.", labels=["position"])
        for position, count in enumerate(m["num_accepted_tokens_per_pos"]):
            per_pos.add_metric([str(position)], count)
        yield per_pos
        gauges = (("spec_decode_mean_acceptance_length", "Mean tokens committed per verify step (tau).",
                   m["mean_acceptance_length"]),
                  ("num_requests_running", "Requests being decoded.", engine.num_running),
                  ("num_requests_waiting", "Requests waiting for a slot.", engine.num_waiting),
                  ("kv_pages_used", "KV pages in use.", m["num_kv_pages_used"]),
                  ("kv_pages_total", "KV pages of the replica.", m["num_kv_pages"]),
                  ("kv_pages_cached", "KV pages holding a reusable prompt prefix (held or evictable).",
                   m["num_kv_pages_cached"]),
                  ("speculation_disabled", "1 once the acceptance gate turned speculation off.",
                   float(m["speculation_disabled"])))
        for name, doc, value in gauges:
            yield GaugeMetricFamily(f"{PREFIX}:{name}", doc, value=value)
        if "replica_parked" in m:  # a Ray replica (cluster.executor: idle parking)
            yield CounterMetricFamily(f"{PREFIX}:replica_idle_parks", "Times the replica parked its step graph "
                                      "after idle_park_s without a step.", value=m["replica_idle_parks"])
            yield GaugeMetricFamily(f"{PREFIX}:replica_parked", "1 while the replica's step graph is parked (idle).",
                                    value=float(m["replica_parked"]))
        if "pipelined_steps" in m:  # a pipelined separate drafter (parallel.pipeline_drafter)
            yield CounterMetricFamily(f"{PREFIX}:pipelined_steps", "Steps a pipelined separate drafter ran pipelined "
                                      "(while pipeline_drafter_min_batch requests ran or waited).",
                                      value=m["pipelined_steps"])
        scheduling = m.get("confidence_scheduling")
        if scheduling is not None:  # enable_confidence_scheduling
            last = scheduling["last"]
            for name, doc, value in (
                    ("confidence_verify_budget", "Drafts the last scheduled step verifies over the batch.",
                     last.get("verify_budget", 0)),
                    ("confidence_drafts_offered", "Drafts proposed to the last scheduled step.",
                     last.get("offered", 0)),
                    ("confidence_predicted_step_seconds", "The step time the table predicted for the last step.",
                     last.get("predicted_step_ms", 0.0) / 1e3),
                    ("confidence_measured_step_seconds", "The last scheduled step's measured time.",
                     last.get("measured_step_ms", 0.0) / 1e3),
                    ("confidence_plain_step_seconds", "What plain decoding of the last scheduled step's requests "
                     "was priced at: its drafting was judged against it (0: no plain steps profiled).",
                     (last.get("plain_step_ms") or 0.0) / 1e3),
                    ("confidence_drafting_paid_share", "Share of the decisions whose drafting beat plain decoding "
                     "(since startup or the last metrics reset; 0 before any was judged).",
                     scheduling["drafting_paid_share"] or 0.0),
                    ("confidence_mean_verify_budget_per_request", "Mean drafts verified per request and step.",
                     scheduling["mean_verify_budget_per_request"]),
                    ("confidence_step_seconds_per_context_token", "What one KV token of context adds to a step, "
                     "as the step-time table learned it from the served steps (0 until learned).",
                     scheduling["cost_table_ms_per_context_token"] / 1e3),
                    ("confidence_drafting_off_steps", "Steps that drafted nothing because no verify paid its "
                     "step against plain decoding (drafting holds; since startup or the last metrics reset).",
                     scheduling["drafting_off_steps"]),
                    ("confidence_drafting_holds", "Drafting holds begun since startup (each a stretch of plain "
                     "decoding at one batch size, then one block drafted to look again).",
                     scheduling["drafting_holds"]),
                    ("confidence_drafting_judgements_reversed", "Of the judgements that began a drafting hold, "
                     "those the survival refit after their step reversed (the hold ended at once; since startup).",
                     scheduling["drafting_judgements_reversed"]),
                    ("confidence_drafting_mixed_holds_ended", "Drafting holds a mixed step's judgement began (prompt "
                     "chunks beside the verifies) that the first decode step after them ended (since startup).",
                     scheduling["drafting_mixed_holds_ended"]),
                    ("confidence_serial_steps", "Steps the replica could have launched ahead of the step before "
                     "and did not (after a prefill, sampled batches): priced with the host's step work on top "
                     "(since startup or the last metrics reset).", scheduling["serial_steps"])):
                yield GaugeMetricFamily(f"{PREFIX}:{name}", doc, value=value)
            yield per_position("confidence_survival_correction", "Survived over predicted survival of the drafts "
                               "verified at each block position, predicted by the offline calibration alone (how "
                               "far off it is here).", scheduling["survival_correction"])
            yield per_position("confidence_survival_skill", "Brier skill of the believed survivals of the drafts "
                               "verified at each block position against the position's observed rate (0: no request "
                               "told apart; 1: every draft foretold); positions without evidence are left out.",
                               scheduling["survival_skill_per_position"])
            fit = scheduling["survival_fit"]
            yield per_position("confidence_survival_slope", "The online survival fit's slope on the head's logit at "
                               "each block position (1 / the calibration temperature until evidence moves it; 0: the "
                               "head tells nothing here).", fit["slope"])
            bias = GaugeMetricFamily(f"{PREFIX}:confidence_survival_bias", "The online survival fit's bias at each "
                                     "block position for requests of each verify history (what the request's last "
                                     "verify with drafts did: none, rejected_at_j after j accepted drafts, "
                                     "accepted_n of n).",
                                     labels=["position", "history"])
            for history, values in fit["bias"].items():
                for position, value in enumerate(values):
                    bias.add_metric([str(position), history], value)
            yield bias
        info = InfoMetricFamily(f"{PREFIX}:moe_backend", "MoE backend resolved on each rank.", labels=["rank", "role"])
        for rank in self.rank_info:
            info.add_metric([str(rank["rank"]), rank["role"]], {"backend": str(rank.get("moe_backend")),
                                                                "draft_backend": str(rank.get("draft_moe_backend"))})
        yield info


def per_position(name: str, doc: str, values: list[float | None]) -> GaugeMetricFamily:
    """A gauge family of one value per block position (a None left out)."""
    family = GaugeMetricFamily(f"{PREFIX}:{name}", doc, labels=["position"])
    for position, value in enumerate(values):
        if value is not None:
            family.add_metric([str(position)], value)
    return family


class ServerMetrics:
    def __init__(self, engine_of: Callable[[], Engine], rank_info: list[dict]):
        self.registry = CollectorRegistry()
        self.registry.register(EngineCollector(engine_of, rank_info))
        self.ttft = Histogram(f"{PREFIX}:time_to_first_token_seconds", "Time to the first generated token.",
                              buckets=LATENCY_BUCKETS, registry=self.registry)
        self.tpot = Histogram(f"{PREFIX}:time_per_output_token_seconds", "Mean time per output token after the "
                              "first, per request.", buckets=LATENCY_BUCKETS, registry=self.registry)
        self.e2e = Histogram(f"{PREFIX}:e2e_request_latency_seconds", "Request latency, arrival to last token.",
                             buckets=LATENCY_BUCKETS, registry=self.registry)

    def observe(self, arrival: float, first_token: float | None, end: float, num_tokens: int) -> None:
        if first_token is not None:
            self.ttft.observe(first_token - arrival)
            if num_tokens > 1:
                self.tpot.observe((end - first_token) / (num_tokens - 1))
        self.e2e.observe(end - arrival)

    def render(self) -> bytes:
        return generate_latest(self.registry)
