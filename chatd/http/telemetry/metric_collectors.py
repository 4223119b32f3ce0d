"""The Prometheus collectors ServerMetrics (metrics.py) builds on, for values that come many at
once: each chat model's engine stats read at scrape time, a request's inter-token latencies
counted in one numpy call, and a view of a registry without prometheus-client's `_created` series.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

import numpy as np
from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from chatd.engine import STAGES

if TYPE_CHECKING:
    from chatd.engine import EngineStats

# The APIs that generate, as the per-request series' `route` label: /v1/chat/completions,
# /v1/completions, /v1/responses and a conversation's /messages (the chat page).
ROUTES = ("chat", "completions", "responses", "conversation")
# Engine series that vLLM exposes with the same meaning (vllm/v1/metrics/loggers.py), repeated as
# `vllm:NAME` with vLLM's labels: SGLang's gateway (smg) takes a vLLM worker's load from the first
# three (its monitor.rs: running, waiting, KV usage 0..1), and vLLM dashboards plot the hit rate
# from the two token counters. One engine core serves here: vLLM's `engine` label is "0".
VLLM_NAMED = ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
              "prefix_cache_queries", "prefix_cache_hits")


class WithoutCreated(Collector):
    """A registry's metrics without the `*_created` timestamps prometheus-client adds.

    The text format shows each as an extra gauge family (`chatd:request_success_created`),
    doubling what a reader scans for no use here. `disable_created_metrics()` would drop them
    too, but for the whole process; this view drops them only from our own output.
    """

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry

    def collect(self) -> Iterable[Metric]:
        """Yield the registry's families minus their `_created` samples."""
        for family in self.registry.collect():  # fresh objects on every collect: safe to trim
            family.samples = [s for s in family.samples if not s.name.endswith("_created")]
            yield family


class BulkHistogram(Collector):
    """A histogram by model and route whose values come many at once: a request's inter-token
    latencies, one a token, counted in one numpy call when it ends (an observe() a value cost
    ~1.5 us a token). Exposed as prometheus-client's Histogram exposes one (`_bucket` with `le`,
    `_count`, `_sum`)."""

    def __init__(self, name: str, documentation: str, buckets: Sequence[float]) -> None:
        self.name, self.documentation = name, documentation
        self.bounds = np.array(buckets, dtype=np.float64)
        self.counts: dict[tuple[str, str], np.ndarray] = {}  # (model, route) -> counts a bucket; the last: +Inf
        self.sums: dict[tuple[str, str], float] = {}

    def declare(self, model_name: str) -> None:
        for route in ROUTES:
            self.counts.setdefault((model_name, route), np.zeros(len(self.bounds) + 1, dtype=np.int64))
            self.sums.setdefault((model_name, route), 0.0)

    def observe_many(self, model_name: str, route: str, values: Sequence[float]) -> None:
        if values:
            if (model_name, route) not in self.counts:
                self.declare(model_name)
            # A value equal to a bound is in that bound's bucket (`le`): the first bound >= it.
            self.counts[model_name, route] += np.bincount(np.searchsorted(self.bounds, values),
                                                          minlength=len(self.bounds) + 1)
            self.sums[model_name, route] += float(np.sum(values))

    def describe(self) -> Iterable[Metric]:
        return self.collect()

    def collect(self) -> Iterable[Metric]:
        family = HistogramMetricFamily(self.name, self.documentation, labels=["model_name", "route"])
        les = [floatToGoString(bound) for bound in self.bounds] + ["+Inf"]
        for (model_name, route), counts in list(self.counts.items()):
            cumulative = np.cumsum(counts).tolist()
            family.add_metric([model_name, route], list(zip(les, cumulative)), self.sums[model_name, route])
        yield family


class EngineCollector:
    """Each chat model's engine gauges and counters, read from its latest EngineStats at scrape time.

    The engine already keeps cumulative totals. Exposing them as they are at scrape time is
    exact and needs no bookkeeping, where mirroring them into prometheus Counters would mean
    keeping the last values and adding deltas. If an engine restarts (a model unloaded and loaded
    again) its totals fall to zero, which Prometheus reads as a counter reset, as it should.
    """

    def __init__(self) -> None:
        self.models: dict[str, _EngineSeries] = {}

    def declare(self, model_name: str, kv_bytes_per_token: int, block_size: int) -> None:
        self.models.setdefault(model_name, _EngineSeries(kv_bytes_per_token, block_size))

    def update(self, model_name: str, stats: EngineStats | None, stage_times: dict[str, float] | None,
               kv_bytes_per_token: int, block_size: int) -> None:
        series = self.models.setdefault(model_name, _EngineSeries(kv_bytes_per_token, block_size))
        if kv_bytes_per_token:
            series.kv_bytes_per_token, series.kv_block_bytes = kv_bytes_per_token, kv_bytes_per_token * block_size
        series.stats = stats
        if stage_times is not None:
            series.stage_times = stage_times

    def describe(self) -> Iterable[Metric]:
        """The families `collect` yields, so the registry can refuse clashing names."""
        return self.collect()

    def collect(self) -> Iterable[Metric]:
        """Yield the engines' gauges and counters, a series per model."""
        families: dict[str, Metric] = {}
        models = list(self.models.items())
        for model_name, series in models:
            for kind, name, documentation, value in series.values():
                family = families.get(name)
                if family is None:
                    family = families[name] = kind(name, documentation, labels=["model_name"])
                family.add_metric([model_name], value)
                short = name.removeprefix("chatd:")
                if short in VLLM_NAMED:  # its twin under vLLM's name and labels, from the same value
                    twin_name = f"vllm:{short}"
                    twin = families.get(twin_name)
                    if twin is None:
                        twin = families[twin_name] = kind(twin_name, f"{documentation} (vLLM's name for {name})",
                                                          labels=["model_name", "engine"])
                    twin.add_metric([model_name, "0"], value)
        yield from families.values()
        stages = CounterMetricFamily("chatd:engine_stage_seconds", "Seconds of the host's work per step stage "
                                     "(schedule, inputs, forward, sample, wait, postprocess, detokenize, dispatch).",
                                     labels=["model_name", "stage"])
        # vLLM v0's gauge, which smg still reads as a worker's cache hit rate (v1 dropped it for the
        # two counters): the share of prompt tokens found in the prefix cache, all time.
        hit_rate = GaugeMetricFamily("vllm:gpu_prefix_cache_hit_rate", "Fraction of prompt tokens found in the prefix "
                                     "cache since the start (vLLM v0's name; vllm:prefix_cache_hits / _queries).",
                                     labels=["model_name", "engine"])
        for model_name, series in models:
            for stage in STAGES:
                stages.add_metric([model_name, stage], series.stage_times.get(stage, 0.0))
            stats = series.stats
            queries, hits = (stats.prefix_cache_queries, stats.prefix_cache_hits) if stats else (0, 0)
            hit_rate.add_metric([model_name, "0"], hits / queries if queries else 0.0)
        yield stages
        yield hit_rate


class _EngineSeries:
    """One model's engine values as of its latest update."""

    def __init__(self, kv_bytes_per_token: int, block_size: int) -> None:
        self.kv_bytes_per_token = kv_bytes_per_token
        self.kv_block_bytes = kv_bytes_per_token * block_size
        self.stats: EngineStats | None = None  # None until the first update (or while unloaded): everything reads 0
        self.stage_times: dict[str, float] = {}  # AsyncEngine.stage_times(): seconds per stage, steps, thread CPU

    def values(self) -> list[tuple[type, str, str, float]]:
        """(family kind, name, documentation, value) of each plain series."""
        stats, times = self.stats, self.stage_times  # one read: a concurrent update cannot mix two snapshots
        gauge, counter = GaugeMetricFamily, CounterMetricFamily
        return [
            (gauge, "chatd:num_requests_running", "Requests in the running batch.", stats.num_running if stats else 0),
            (gauge, "chatd:num_requests_waiting", "Requests waiting to be scheduled.", stats.num_waiting if stats else 0),
            (gauge, "chatd:kv_cache_usage_perc", "Fraction of KV cache blocks in use (0..1).",
             stats.kv_cache_usage if stats else 0.0),
            (gauge, "chatd:num_request_streams", "Requests with an open output stream (running, waiting, or not yet "
             "collected).", stats.num_request_streams if stats else 0),
            (gauge, "chatd:kv_blocks", "KV blocks in the device pool.", stats.num_blocks if stats else 0),
            (gauge, "chatd:kv_blocks_free", "Device KV blocks no request holds (some still cache a prefix).",
             stats.num_free_blocks if stats else 0),
            (gauge, "chatd:host_kv_blocks", "KV blocks in the host tier (0: off).", stats.num_host_blocks if stats else 0),
            (gauge, "chatd:host_kv_blocks_used", "Host-tier blocks holding a block evicted from the device.",
             stats.num_host_blocks_used if stats else 0),
            (gauge, "chatd:kv_bytes_per_token", "Bytes of keys and values one token takes, all layers.",
             self.kv_bytes_per_token),
            # CounterMetricFamily adds the `_total` suffix to these names when it exposes them.
            (counter, "chatd:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
             stats.prefix_cache_queries if stats else 0),
            (counter, "chatd:prefix_cache_hits", "Prompt tokens found in the prefix cache.",
             stats.prefix_cache_hits if stats else 0),
            (counter, "chatd:num_preemptions", "Sequences preempted to free KV cache.", stats.num_preemptions if stats else 0),
            (counter, "chatd:prompt_tokens", "Prompt tokens computed in prefill, recomputation included.",
             stats.num_prompt_tokens if stats else 0),
            (counter, "chatd:generation_tokens", "Tokens generated.", stats.num_generation_tokens if stats else 0),
            # Speculative decoding ([speculative]; 0 while it is off): acceptance rate is accepted / draft tokens.
            (counter, "chatd:spec_decode_num_drafts", "Speculative verify steps of a sequence (each checks one or more "
             "guessed tokens).", stats.num_drafts if stats else 0),
            (counter, "chatd:spec_decode_num_draft_tokens", "Guessed tokens verified by speculative decoding.",
             stats.num_draft_tokens if stats else 0),
            (counter, "chatd:spec_decode_num_accepted_tokens", "Guessed tokens accepted (the model sampled the same "
             "token).", stats.num_accepted_tokens if stats else 0),
            (counter, "chatd:host_cache_hits", "Prompt tokens copied back from the host tier instead of recomputed.",
             stats.host_cache_hits if stats else 0),
            (counter, "chatd:kv_blocks_to_host", "KV blocks copied from the device pool to the host tier.",
             stats.num_blocks_to_host if stats else 0),
            (counter, "chatd:kv_blocks_from_host", "KV blocks copied back from the host tier (restored, not recomputed).",
             stats.num_blocks_from_host if stats else 0),
            (counter, "chatd:kv_bytes_to_host", "Bytes of KV copied to the host tier.",
             stats.num_blocks_to_host * self.kv_block_bytes if stats else 0),
            (counter, "chatd:kv_bytes_from_host", "Bytes of KV copied back from the host tier.",
             stats.num_blocks_from_host * self.kv_block_bytes if stats else 0),
            (counter, "chatd:engine_steps", "Engine steps run.", times.get("steps", 0)),
            (counter, "chatd:engine_thread_cpu_seconds", "CPU seconds the engine thread used (it holds the GIL for most "
             "of them).", times.get("engine_thread_cpu", 0.0)),
        ]
