"""ServerMetrics: the exposed names, labels and values, read back through prometheus' own parser."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from chatd.engine import EngineStats, FinishReason
from chatd.http.telemetry.metrics import LATENCY_BUCKETS, ROUTES, ServerMetrics

MODEL = "tiny-llama"

ENGINE_FAMILIES = {
    "chatd:num_requests_running": "gauge",
    "chatd:num_requests_waiting": "gauge",
    "chatd:kv_cache_usage_perc": "gauge",
    "chatd:num_request_streams": "gauge",
    "chatd:prefix_cache_queries": "counter",
    "chatd:prefix_cache_hits": "counter",
    "chatd:num_preemptions": "counter",
    "chatd:prompt_tokens": "counter",
    "chatd:generation_tokens": "counter",
    "chatd:spec_decode_num_drafts": "counter",
    "chatd:spec_decode_num_draft_tokens": "counter",
    "chatd:spec_decode_num_accepted_tokens": "counter",
    "chatd:kv_blocks": "gauge",
    "chatd:kv_blocks_free": "gauge",
    "chatd:host_kv_blocks": "gauge",
    "chatd:host_kv_blocks_used": "gauge",
    "chatd:kv_bytes_per_token": "gauge",
    "chatd:host_cache_hits": "counter",
    "chatd:kv_blocks_to_host": "counter",
    "chatd:kv_blocks_from_host": "counter",
    "chatd:kv_bytes_to_host": "counter",
    "chatd:kv_bytes_from_host": "counter",
    "chatd:engine_steps": "counter",
    "chatd:engine_thread_cpu_seconds": "counter",
    "chatd:engine_stage_seconds": "counter",
}
# vLLM's names for the same engine numbers (a gateway or dashboard built for vLLM reads these).
VLLM_FAMILIES = {
    "vllm:num_requests_running": "gauge",
    "vllm:num_requests_waiting": "gauge",
    "vllm:kv_cache_usage_perc": "gauge",
    "vllm:prefix_cache_queries": "counter",
    "vllm:prefix_cache_hits": "counter",
    "vllm:gpu_prefix_cache_hit_rate": "gauge",
}
REQUEST_FAMILIES = {
    "chatd:request_success": "counter",
    "chatd:time_to_first_token_seconds": "histogram",
    "chatd:inter_token_latency_seconds": "histogram",
    "chatd:e2e_request_latency_seconds": "histogram",
    "chatd:request_queue_time_seconds": "histogram",
    "chatd:request_prompt_tokens": "histogram",
    "chatd:request_generation_tokens": "histogram",
    "chatd:alias_requests": "counter",  # [aliases]: which model each served, and why
    "chatd:model_loads": "counter",  # [[models]] coming and going
    "chatd:model_unloads": "counter",
    "chatd:model_load_seconds": "histogram",
    "chatd:feedback": "counter",  # users' ratings of replies
    "chatd:trace_spans": "counter",  # spans exported, sampled out and dropped ([tracing] on)
    "chatd:canary_weight": "gauge",  # ramped canaries
    "chatd:canary_changes": "counter",
    # What the alerts page on (deploy/prometheus/chatd.rules.yml), read at scrape time.
    "chatd:store_writable": "gauge",
    "chatd:store_pending_writes": "gauge",
    "chatd:limit_store_up": "gauge",
    "chatd:engine_failed": "gauge",
    "chatd:tier_ttft_p95_objective_seconds": "gauge",
    "chatd:usage_tokens": "counter",  # billed usage by tier and model
    "chatd:usage_cost_usd": "counter",
}
TIER_FAMILIES = {
    "chatd:tier_requests_admitted": "counter",
    "chatd:tier_requests_rate_limited": "counter",
    "chatd:tier_requests_shed": "counter",
    "chatd:tier_time_to_first_token_seconds": "histogram",
    "chatd:tier_request_queue_time_seconds": "histogram",
}


def make_stats(**overrides) -> EngineStats:
    """An EngineStats with every field zero unless given."""
    fields = dict(
        num_running=0, num_waiting=0, kv_cache_usage=0.0, num_blocks=100, num_free_blocks=100,
        prefix_cache_queries=0, prefix_cache_hits=0, num_preemptions=0,
        num_prompt_tokens=0, num_generation_tokens=0,
    )  # fmt: skip
    fields.update(overrides)
    return EngineStats(**fields)


def observe(metrics: ServerMetrics, **overrides) -> None:
    """Record one finished request with plain defaults."""
    request = dict(
        route="chat", finish_reason="stop", prompt_tokens=10, generation_tokens=5, cached_tokens=0,
        ttft=0.05, e2e=0.5, queue_time=0.01, inter_token_latencies=[0.1, 0.1, 0.1, 0.1],
    )  # fmt: skip
    request.update(overrides)
    metrics.observe_request(**request)


def scrape(metrics: ServerMetrics) -> dict[str, float]:
    """Render and parse; map `sample_name{label=value,...}` to its value."""
    body, _ = metrics.render()
    samples = {}
    for family in text_string_to_metric_families(body.decode()):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
            samples[f"{sample.name}{{{labels}}}"] = sample.value
    return samples


def families(metrics: ServerMetrics) -> dict[str, str]:
    """Family name -> type, as a scraper sees them."""
    body, _ = metrics.render()
    return {f.name: f.type for f in text_string_to_metric_families(body.decode())}


def test_exposes_exactly_the_documented_families():
    assert families(ServerMetrics(MODEL)) == ENGINE_FAMILIES | VLLM_FAMILIES | REQUEST_FAMILIES | TIER_FAMILIES


def test_exposed_text_has_vllm_style_names_with_total_suffix():
    body, content_type = ServerMetrics(MODEL).render()
    assert content_type.startswith("text/plain")
    lines = [line for line in body.decode().splitlines() if not line.startswith("#")]
    server_wide = {"chatd:store_writable", "chatd:store_pending_writes", "chatd:limit_store_up",
                   "chatd:trace_spans_total"}  # no model's
    assert all(f'model_name="{MODEL}"' in line for line in lines if line.split("{")[0].split(" ")[0] not in server_wide)
    exposed = {line.split("{")[0].split(" ")[0] for line in lines}
    counters = ({name.removeprefix("chatd:") for name, kind in ENGINE_FAMILIES.items() if kind == "counter"}
                | {"request_success", "model_loads", "model_unloads", "feedback"})
    gauges = {name.removeprefix("chatd:") for name, kind in ENGINE_FAMILIES.items() if kind == "gauge"}
    histograms = {name.removeprefix("chatd:") for name, kind in REQUEST_FAMILIES.items() if kind == "histogram"}
    expected = (
        {f"chatd:{name}_total" for name in counters}
        | {f"chatd:{name}" for name in gauges}
        | {f"{name}_total" if kind == "counter" else name for name, kind in VLLM_FAMILIES.items()}
        | {f"chatd:{name}_{part}" for name in histograms for part in ("bucket", "count", "sum")}
        | server_wide
    )
    assert exposed == expected  # no `_total_total`, no `_created` series


def test_engine_values_read_zero_before_the_first_update():
    samples = scrape(ServerMetrics(MODEL))
    assert samples[f"chatd:num_requests_running{{model_name={MODEL}}}"] == 0
    assert samples[f"chatd:prompt_tokens_total{{model_name={MODEL}}}"] == 0
    for name in ("drafts", "draft_tokens", "accepted_tokens"):  # speculative decoding: exported while off too
        assert samples[f"chatd:spec_decode_num_{name}_total{{model_name={MODEL}}}"] == 0


def test_gauges_show_the_latest_engine_state():
    metrics = ServerMetrics(MODEL)
    metrics.update_engine(make_stats(num_running=3, num_waiting=7, kv_cache_usage=0.25))
    metrics.update_engine(make_stats(num_running=1, num_waiting=0, kv_cache_usage=0.5))
    samples = scrape(metrics)
    assert samples[f"chatd:num_requests_running{{model_name={MODEL}}}"] == 1
    assert samples[f"chatd:num_requests_waiting{{model_name={MODEL}}}"] == 0
    assert samples[f"chatd:kv_cache_usage_perc{{model_name={MODEL}}}"] == 0.5


def test_each_model_of_a_fleet_has_its_own_series_and_an_unloaded_one_reads_zero():
    metrics = ServerMetrics(MODEL)
    metrics.declare_model("canary", kv_bytes_per_token=512, block_size=16)
    samples = scrape(metrics)  # declared: at 0 before its first request
    assert samples["chatd:request_success_total{finished_reason=stop,model_name=canary,route=chat}"] == 0
    assert samples["chatd:num_requests_running{model_name=canary}"] == 0
    metrics.update_engine(make_stats(num_running=3, num_generation_tokens=40))
    metrics.update_engine(make_stats(num_running=5, num_generation_tokens=7), model_name="canary")
    observe(metrics, model_name="canary")
    metrics.alias_picked("chat", "canary", "weight")
    samples = scrape(metrics)
    assert samples[f"chatd:num_requests_running{{model_name={MODEL}}}"] == 3
    assert samples["chatd:num_requests_running{model_name=canary}"] == 5
    assert samples["vllm:num_requests_running{engine=0,model_name=canary}"] == 5
    assert samples["chatd:request_success_total{finished_reason=stop,model_name=canary,route=chat}"] == 1
    assert samples[f"chatd:request_success_total{{finished_reason=stop,model_name={MODEL},route=chat}}"] == 0
    assert samples["chatd:kv_bytes_per_token{model_name=canary}"] == 512
    assert samples["chatd:alias_requests_total{alias=chat,model_name=canary,why=weight}"] == 1
    metrics.update_engine(None, {}, "canary")  # unloaded
    assert scrape(metrics)["chatd:generation_tokens_total{model_name=canary}"] == 0


def test_tier_safety_and_load_series_carry_the_model_that_served():
    """With several models, a tier's admissions and refusals, a safety decision and a model's loads
    and unloads are counted under the model they were for, each at 0 from the start."""
    metrics = ServerMetrics(MODEL)
    metrics.declare_model("large")
    metrics.declare_tiers(["free"])
    metrics.declare_safety(["violence"])
    samples = scrape(metrics)
    assert samples["chatd:tier_requests_admitted_total{model_name=large,tier=free}"] == 0
    assert samples["chatd:safety_actions_total{action=block,category=violence,model_name=large,stage=input}"] == 0
    assert samples["chatd:model_unloads_total{model_name=large,reason=idle}"] == 0
    metrics.tier_admitted("free", "large")
    metrics.tier_refused("free", "tokens", "large")
    metrics.tier_first_token("free", 0.2, 0.1, "large")
    metrics.safety_action("violence", "input", "block", "large")
    metrics.model_loaded("large", 3.0)
    metrics.model_loaded("large", None)
    metrics.model_unloaded("large", "idle")
    samples = scrape(metrics)
    assert samples["chatd:tier_requests_admitted_total{model_name=large,tier=free}"] == 1
    assert samples[f"chatd:tier_requests_admitted_total{{model_name={MODEL},tier=free}}"] == 0
    assert samples["chatd:tier_requests_rate_limited_total{model_name=large,reason=tokens,tier=free}"] == 1
    assert samples["chatd:tier_time_to_first_token_seconds_count{model_name=large,tier=free}"] == 1
    assert samples["chatd:safety_actions_total{action=block,category=violence,model_name=large,stage=input}"] == 1
    assert samples["chatd:model_loads_total{model_name=large,outcome=loaded}"] == 1
    assert samples["chatd:model_loads_total{model_name=large,outcome=failed}"] == 1
    assert samples["chatd:model_load_seconds_sum{model_name=large}"] == 3.0
    assert samples["chatd:model_unloads_total{model_name=large,reason=idle}"] == 1


def test_vllm_names_read_the_same_values_with_vllms_labels():
    """A router or dashboard built for vLLM (smg scrapes vllm:num_requests_running, _waiting and
    kv_cache_usage_perc) reads what chatd's own names say."""
    metrics = ServerMetrics(MODEL)
    metrics.update_engine(make_stats(num_running=3, num_waiting=2, kv_cache_usage=0.375,
                                     prefix_cache_queries=200, prefix_cache_hits=48))
    samples = scrape(metrics)
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "prefix_cache_queries_total",
                 "prefix_cache_hits_total"):
        assert samples[f"vllm:{name}{{engine=0,model_name={MODEL}}}"] == samples[f"chatd:{name}{{model_name={MODEL}}}"]
    assert samples[f"vllm:kv_cache_usage_perc{{engine=0,model_name={MODEL}}}"] == 0.375  # a fraction, as vLLM's
    assert samples[f"vllm:gpu_prefix_cache_hit_rate{{engine=0,model_name={MODEL}}}"] == 48 / 200
    assert scrape(ServerMetrics(MODEL))[f"vllm:gpu_prefix_cache_hit_rate{{engine=0,model_name={MODEL}}}"] == 0


def test_counters_grow_by_the_engine_deltas_across_updates():
    metrics = ServerMetrics(MODEL)
    first = dict(prefix_cache_queries=100, prefix_cache_hits=40, num_preemptions=1, num_prompt_tokens=100, num_generation_tokens=20,
                 num_drafts=4, num_draft_tokens=12, num_accepted_tokens=7)
    second = dict(prefix_cache_queries=250, prefix_cache_hits=140, num_preemptions=3, num_prompt_tokens=180, num_generation_tokens=95,
                  num_drafts=10, num_draft_tokens=27, num_accepted_tokens=19)
    metrics.update_engine(make_stats(**first))
    before = scrape(metrics)
    metrics.update_engine(make_stats(**second))
    after = scrape(metrics)
    names = {
        "prefix_cache_queries": "prefix_cache_queries", "prefix_cache_hits": "prefix_cache_hits",
        "num_preemptions": "num_preemptions", "num_prompt_tokens": "prompt_tokens",
        "num_generation_tokens": "generation_tokens", "num_drafts": "spec_decode_num_drafts",
        "num_draft_tokens": "spec_decode_num_draft_tokens", "num_accepted_tokens": "spec_decode_num_accepted_tokens",
    }  # fmt: skip
    for field, name in names.items():
        key = f"chatd:{name}_total{{model_name={MODEL}}}"
        assert before[key] == first[field]
        assert after[key] - before[key] == second[field] - first[field]


def test_request_success_is_counted_per_finish_reason():
    metrics = ServerMetrics(MODEL)
    observe(metrics, finish_reason="stop")
    observe(metrics, finish_reason="stop")
    observe(metrics, finish_reason=FinishReason.LENGTH)  # the enum is accepted as well as its value
    samples = scrape(metrics)
    count = {r.value: samples[f"chatd:request_success_total{{finished_reason={r.value},model_name={MODEL},route=chat}}"]
             for r in FinishReason}
    assert count == {"stop": 2, "length": 1, "abort": 0, "error": 0, "content_filter": 0}


def test_an_unknown_finish_reason_is_refused():
    with pytest.raises(ValueError):
        observe(ServerMetrics(MODEL), finish_reason="timeout")


def test_each_route_has_its_own_series_from_the_start():
    metrics = ServerMetrics(MODEL)
    before = scrape(metrics)
    for route in ROUTES:  # every route at 0 before its first request, so rate() works
        assert before[f"chatd:request_success_total{{finished_reason=stop,model_name={MODEL},route={route}}}"] == 0
        assert before[f"chatd:time_to_first_token_seconds_count{{model_name={MODEL},route={route}}}"] == 0
    observe(metrics, route="conversation", ttft=0.2, e2e=1.0)
    observe(metrics, route="responses", ttft=0.3, e2e=2.0)
    samples = scrape(metrics)
    assert samples[f"chatd:request_success_total{{finished_reason=stop,model_name={MODEL},route=conversation}}"] == 1
    assert samples[f"chatd:e2e_request_latency_seconds_sum{{model_name={MODEL},route=responses}}"] == pytest.approx(2.0)
    assert samples[f"chatd:time_to_first_token_seconds_count{{model_name={MODEL},route=chat}}"] == 0
    with pytest.raises(ValueError):  # a label value nobody declared is a bug, not a new series
        observe(metrics, route="/v1/conversations/conv_123/messages")


def test_histograms_count_and_sum_observations():
    metrics = ServerMetrics(MODEL)
    observe(metrics, prompt_tokens=10, generation_tokens=5, ttft=0.05, e2e=0.5, queue_time=0.01, inter_token_latencies=[0.1, 0.2])
    observe(metrics, prompt_tokens=30, generation_tokens=1, ttft=0.25, e2e=1.5, queue_time=0.03, inter_token_latencies=[])
    samples = scrape(metrics)

    def count_and_sum(name: str) -> tuple[float, float]:
        labels = f"{{model_name={MODEL},route=chat}}"
        return samples[f"chatd:{name}_count{labels}"], samples[f"chatd:{name}_sum{labels}"]

    assert count_and_sum("request_prompt_tokens") == (2, 40)
    assert count_and_sum("request_generation_tokens") == (2, 6)
    assert count_and_sum("time_to_first_token_seconds") == pytest.approx((2, 0.30))
    assert count_and_sum("e2e_request_latency_seconds") == pytest.approx((2, 2.0))
    assert count_and_sum("request_queue_time_seconds") == pytest.approx((2, 0.04))
    assert count_and_sum("inter_token_latency_seconds") == pytest.approx((2, 0.3))  # one sample per gap
    assert samples[f"chatd:request_prompt_tokens_bucket{{le=16.0,model_name={MODEL},route=chat}}"] == 1
    assert samples[f"chatd:request_prompt_tokens_bucket{{le=32.0,model_name={MODEL},route=chat}}"] == 2


def test_a_request_that_never_started_skips_ttft_and_queue_time():
    metrics = ServerMetrics(MODEL)
    observe(metrics, finish_reason="abort", generation_tokens=0, ttft=None, queue_time=None, inter_token_latencies=[])
    samples = scrape(metrics)
    assert samples[f"chatd:time_to_first_token_seconds_count{{model_name={MODEL},route=chat}}"] == 0
    assert samples[f"chatd:request_queue_time_seconds_count{{model_name={MODEL},route=chat}}"] == 0
    assert samples[f"chatd:e2e_request_latency_seconds_count{{model_name={MODEL},route=chat}}"] == 1


def test_latency_buckets_span_a_millisecond_to_over_a_minute():
    assert LATENCY_BUCKETS[0] <= 0.001 and LATENCY_BUCKETS[-1] > 60
    samples = scrape(ServerMetrics(MODEL))
    assert f"chatd:e2e_request_latency_seconds_bucket{{le=0.001,model_name={MODEL},route=chat}}" in samples
    assert f"chatd:request_generation_tokens_bucket{{le=32768.0,model_name={MODEL},route=chat}}" in samples


def test_two_instances_share_no_state():
    a, b = ServerMetrics(MODEL), ServerMetrics("other-model")
    a.update_engine(make_stats(num_running=4, num_generation_tokens=50))
    observe(a)
    samples_b = scrape(b)
    assert samples_b["chatd:num_requests_running{model_name=other-model}"] == 0
    assert samples_b["chatd:generation_tokens_total{model_name=other-model}"] == 0
    assert samples_b["chatd:request_success_total{finished_reason=stop,model_name=other-model,route=chat}"] == 0
    assert not any(MODEL in key for key in samples_b)
    # Building a second one with the same model name must not clash either (one registry each).
    ServerMetrics(MODEL)


def test_tier_series_start_at_zero_and_count_admissions_refusals_and_first_tokens():
    metrics = ServerMetrics(MODEL)
    metrics.declare_tiers(["free", "paid"])
    before = scrape(metrics)
    assert before[f"chatd:tier_requests_shed_total{{model_name={MODEL},reason=overloaded,tier=free}}"] == 0
    assert before[f"chatd:tier_requests_rate_limited_total{{model_name={MODEL},reason=tokens,tier=paid}}"] == 0
    metrics.tier_admitted("paid")
    metrics.tier_refused("free", "overloaded")
    metrics.tier_refused("free", "requests")
    metrics.tier_first_token("paid", 0.3, 0.1)
    after = scrape(metrics)
    assert after[f"chatd:tier_requests_admitted_total{{model_name={MODEL},tier=paid}}"] == 1
    assert after[f"chatd:tier_requests_shed_total{{model_name={MODEL},reason=overloaded,tier=free}}"] == 1
    assert after[f"chatd:tier_requests_rate_limited_total{{model_name={MODEL},reason=requests,tier=free}}"] == 1
    assert after[f"chatd:tier_time_to_first_token_seconds_count{{model_name={MODEL},tier=paid}}"] == 1
    assert after[f"chatd:tier_request_queue_time_seconds_sum{{model_name={MODEL},tier=paid}}"] == pytest.approx(0.1)


def test_the_host_tier_reads_as_blocks_and_bytes_moved_each_way():
    metrics = ServerMetrics(MODEL, kv_bytes_per_token=1024, block_size=16)
    metrics.update_engine(make_stats(num_host_blocks=50, num_host_blocks_used=12, host_cache_hits=64,
                                     num_blocks_to_host=12, num_blocks_from_host=4))
    samples = scrape(metrics)
    label = f"{{model_name={MODEL}}}"
    assert samples[f"chatd:host_kv_blocks{label}"] == 50
    assert samples[f"chatd:host_kv_blocks_used{label}"] == 12
    assert samples[f"chatd:host_cache_hits_total{label}"] == 64
    assert samples[f"chatd:kv_bytes_to_host_total{label}"] == 12 * 16 * 1024
    assert samples[f"chatd:kv_bytes_from_host_total{label}"] == 4 * 16 * 1024
    assert samples[f"chatd:kv_bytes_per_token{label}"] == 1024
