"""A plan document (planner.py) as text: the result first, then every input and model it came from.

Only formatting: every number printed is in the document `--json` prints.
"""

from __future__ import annotations

GIB = 2**30


def format_plan(doc: dict) -> str:
    """The plan as readable text, in sections: result, constraints, model, device, curve, traffic, inputs, models."""
    model, device, curve, traffic, result = doc["model"], doc["device"], doc["curve"], doc["traffic"], doc["result"]
    lines = [f"chatd plan: {model['source']} on {device['kind']} ({device['name']})", ""]
    lines += ["Result"]
    if result["replicas"] is None:
        lines += ["  sessions per GPU: 0: not one session meets the latency objective (see warnings)"]
    else:
        lines += [
            f"  sessions per GPU:  {result['sessions_per_gpu']} (binding: {', '.join(result['binding'])})",
            f"  replicas (GPUs):   {result['replicas']} for a peak of {traffic['peak_sessions']:,.1f} sessions",
            f"  per GPU there:     decode step {result['step_seconds'] * 1e3:.2f} ms, TPOT {result['tpot_seconds'] * 1e3:.2f} ms, "
            f"p95 TTFT {result['ttft_p95_seconds']:.3f} s",
            f"                     {result['output_tokens_per_s']:,.0f} output tokens/s, {result['tokens_per_s']:,.0f} tokens/s "
            "(prompt and output)",
        ]
        if result["usd_per_m_tokens"] is not None:
            lines += [
                f"  cost:              ${result['usd_per_m_output_tokens']:.4f} per M output tokens, "
                f"${result['usd_per_m_tokens']:.4f} per M tokens (a GPU full)",
                f"                     ${result['usd_per_day']:,.2f} a day for {result['replicas']} GPU(s) all day: "
                f"${result['usd_per_m_tokens_day']:.4f} per M of the day's {traffic['tokens_per_day']:,.0f} tokens",
            ]
        else:
            lines += ["  cost:              not computed (no --gpu-hour-usd for this device)"]
    lines += ["", "Constraints (sessions per GPU)"]
    for c in result["constraints"]:
        capped = " (allows more; capped where the curve or scheduler ends)" if c["capped"] else ""
        lines += [f"  {c['name']:<32} {c['sessions']:>6}{capped}"]
    lines += [
        "",
        "Model",
        f"  {model['architecture']}: {model['num_hidden_layers']} layers, hidden {model['hidden_size']}, "
        f"{model['num_attention_heads']} heads, {model['num_key_value_heads']} kv heads, head_dim {model['head_dim']}, "
        f"intermediate {model['intermediate_size']}, vocab {model['vocab_size']}, context window {model['max_model_len']}",
        f"  {model['num_params']:,} parameters; weights {model['dtype']}, quantization {model['quantization']}: "
        f"{model['weights_bytes'] / GIB:.2f} GiB",
        f"  KV bytes/token: {model['kv_formula']}",
        f"  a session's KV: {traffic['session_kv_bytes']:,} bytes (context in whole blocks)",
        "",
        "Device",
    ]
    if "memory_bytes" in device:
        lines += [f"  memory {device['memory_bytes'] / GIB:.2f} GiB"]
    lines += [f"  KV budget {device['kv_budget_bytes'] / GIB:.2f} GiB = {device['kv_budget_formula']}", "", "Step-time curve"]
    lines += [
        f"  {curve['name']} ({curve['found_by']})",
        f"  source: {curve['source']}",
        f"  device: {curve['device']}; date: {curve['date'] or '?'}",
        f"  command: {curve['command'] or '?'}",
        f"  measured on: {curve['model'].get('name', '?')}, {curve['dtype']} weights, quantization {curve['quantization']}, "
        f"KV {curve['kv_cache_dtype']}",
        "  decode steps (batch, context, ms): " + ", ".join(f"{p['batch']} x {p['context']}: {p['step_ms']}" for p in curve["decode"]),
        f"  prefill: {curve['prefill']['prompt_tokens']} tokens in {curve['prefill']['ttft_ms']} ms to the first token = "
        f"{curve['prefill_tokens_per_s']:,.0f} tokens/s",
        f"  {curve['interpolation']} (largest: {curve['max_batch']})",
        f"  contexts: {curve['context_method']}",
        "  at the plan's context (batch: ms): " + ", ".join(f"{b}: {ms}" for b, ms in curve["steps_at_plan_context_ms"].items()),
    ]
    lines += [f"  note: {note}" for note in curve["notes"]]
    lines += [
        "",
        "Traffic",
        f"  {traffic['average_turns_per_s']:.4f} turns/s on average, {traffic['peak_turns_per_s']:.4f} at the peak; "
        f"{traffic['peak_sessions']:,.2f} sessions in flight at the peak; {traffic['tokens_per_day']:,.0f} tokens a day",
        "",
        "Inputs",
    ]
    for name, entry in doc["inputs"].items():
        value = entry["value"]
        shown = ",".join(map(str, value)) if isinstance(value, list) else f"{value:g}" if isinstance(value, float) else str(value)
        note = f": {entry['note']}" if "note" in entry else ""
        lines += [f"  {name} {shown} ({entry['source']}{note})"]
    lines += ["", "Models"]
    lines += [f"  {name}: {text}" for name, text in doc["models"].items()]
    if doc["warnings"]:
        lines += ["", "Warnings"] + [f"  {w}" for w in doc["warnings"]]
    return "\n".join(lines)
