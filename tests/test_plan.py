"""`chatd plan`: KV bytes from a model's config, the constraint that binds, replicas, cost, inputs shown, bad flags."""

from __future__ import annotations

import argparse
import json

import pytest
from transformers import LlamaConfig

from chatd.plan import add_parser, main
from chatd.plan.capacity import md1_wait_cdf, md1_wait_quantile
from chatd.plan.curves import read_curve
from chatd.plan.measured import LLAMA_8B_SHAPE
from chatd.plan.model_shape import read_model_shape

TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            intermediate_size=128, vocab_size=1000)
USERS = ["--users", "10000", "--turns-per-day", "20"]


def save_config(folder, **shape):
    LlamaConfig(**shape, tie_word_embeddings=False, max_position_embeddings=131072,
                architectures=["LlamaForCausalLM"]).save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return save_config(tmp_path_factory.mktemp("tiny"), **TINY)


@pytest.fixture(scope="module")
def llama_8b(tmp_path_factory):
    """Llama-3.1-8B's config alone: the shape benchmarks/README.md's H100 step times were measured on."""
    return save_config(tmp_path_factory.mktemp("llama-8b"), **LLAMA_8B_SHAPE)


@pytest.fixture(scope="module")
def tiny_curve(tmp_path_factory):
    """A made-up curve for the tiny model (the numbers are the test's, not a measurement)."""
    path = tmp_path_factory.mktemp("curve") / "curve.json"
    decode = [dict(batch=b, context=c, step_ms=ms) for c, times in ((512, (10, 12, 20, 40)), (2048, (11, 14, 28, 72)))
              for b, ms in zip((1, 8, 64, 256), times)]
    path.write_text(json.dumps(dict(name="test curve", gpu="h100", device="test device", dtype="bfloat16",
                                    model=dict(name="tiny", **TINY), decode=decode,
                                    prefill=dict(prompt_tokens=2000, ttft_ms=100.0))))
    return str(path)


def run_plan(capsys, *argv: str) -> tuple[int, str, str]:
    """`chatd plan ARGV` as the CLI runs it: (exit status, stdout, stderr); argparse's own errors exit 2."""
    parser = argparse.ArgumentParser(prog="chatd")
    add_parser(parser.add_subparsers())
    try:
        args = parser.parse_args(["plan", *argv])
        code = main(args)
    except SystemExit as exc:
        code = exc.code
    out, err = capsys.readouterr()
    return code, out, err


def plan_json(capsys, *argv: str) -> dict:
    code, out, err = run_plan(capsys, *argv, "--json")
    assert code == 0, err
    return json.loads(out)


def test_kv_bytes_per_token_of_a_llama_folder_is_layers_kv_heads_head_dim_k_and_v_bytes(tiny_model):
    shape = read_model_shape(tiny_model)
    assert shape.kv_bytes_per_token("bfloat16") == 2 * 2 * 16 * 2 * 2 == 256
    assert shape.kv_bytes_per_token("fp8_e4m3") == 128
    assert shape.kv_bytes_per_token("float32") == 512
    hidden, inner, vocab, kv = 64, 128, 1000, 2 * 16
    per_layer = hidden * 64 + 2 * hidden * kv + 64 * hidden + 3 * hidden * inner + 2 * hidden
    assert shape.num_params == 2 * vocab * hidden + 2 * per_layer + hidden
    assert shape.weights_bytes("bfloat16", "none") == 2 * shape.num_params


@pytest.mark.slow
def test_default_model_kv_bytes_per_token_as_chatd_reads_its_gguf_file():
    shape = read_model_shape(None)  # SmolLM2-135M-Instruct's Q4_1 file
    assert (shape.num_layers, shape.num_kv_heads, shape.head_dim) == (30, 3, 64)
    assert shape.kv_bytes_per_token("float16") == 30 * 3 * 64 * 2 * 2 == 23_040


def test_8b_on_h100_plans_with_the_readme_figures_and_prints_every_input(capsys, llama_8b):
    code, out, err = run_plan(capsys, "--model", llama_8b, "--gpu", "h100", *USERS)
    assert code == 0, err
    assert "h100-bfloat16-llama-3.1-8b" in out and "8.677" in out and "31.288" in out  # the curve's points
    assert "131,072 bytes" in out  # 32 x 8 x 128 x 2 x 2
    for shown in ("--users 10000 (given)", "--turns-per-day 20 (given)", "--gpu h100 (given)", "--prompt-tokens 1000 (default",
                  "--output-tokens 250 (default", "--context-tokens 1250 (default", "--peak-factor 3 (assumption",
                  "--turn-seconds 16 (default", "--ttft-p95 1 (default", "--tpot 0.06 (default",
                  "--gpu-memory-gib 79.6475 (assumption", "--gpu-memory-utilization 0.9 (default",
                  "--activation-headroom-gib 2 (assumption", "--gpu-hour-usd 2.5 (assumption", "--max-num-seqs 256 (default",
                  "--kv-cache-dtype bfloat16", "--dtype bfloat16", "--quantization none", "block_size 16"):
        assert shown in out
    doc = plan_json(capsys, "--model", llama_8b, "--gpu", "h100", *USERS)
    assert doc["model"]["kv_bytes_per_token"] == 131_072
    assert doc["inputs"]["--users"] == {"value": 10000, "source": "given"}
    assert doc["curve"]["source"].startswith("benchmarks/README.md")


def test_binding_constraint_follows_the_inputs(capsys, tiny_model, tiny_curve):
    base = ("--model", tiny_model, "--gpu", "h100", "--curve", tiny_curve, *USERS)
    long_context = plan_json(capsys, *base, "--context-tokens", "4096", "--gpu-memory-gib", "0.05",
                             "--activation-headroom-gib", "0")
    assert long_context["result"]["binding"] == ["KV memory"]
    tight_tpot = plan_json(capsys, *base, "--tpot", "0.025")
    assert tight_tpot["result"]["binding"] == ["TPOT"]
    assert tight_tpot["result"]["tpot_seconds"] <= 0.025
    tight_ttft = plan_json(capsys, *base, "--ttft-p95", "0.3", "--prompt-tokens", "4000", "--output-tokens", "2000")
    assert tight_ttft["result"]["binding"] == ["TTFT"]
    assert tight_ttft["result"]["ttft_p95_seconds"] <= 0.3
    loose = plan_json(capsys, *base, "--tpot", "1")
    assert loose["result"]["sessions_per_gpu"] == 256  # the curve's largest batch: never past it
    assert "curve's largest measured batch" in loose["result"]["binding"]


def test_replicas_scale_with_users_and_cost_is_the_gpu_hour_over_its_tokens(capsys, tiny_model, tiny_curve):
    base = ("--model", tiny_model, "--gpu", "h100", "--curve", tiny_curve, "--turns-per-day", "20")
    few = plan_json(capsys, *base, "--users", "100000")["result"]
    many = plan_json(capsys, *base, "--users", "1000000")
    assert many["result"]["sessions_per_gpu"] == few["sessions_per_gpu"]
    assert many["result"]["replicas"] == -(-int(many["traffic"]["peak_sessions"] * 1e6) // (few["sessions_per_gpu"] * 10**6))
    assert 9 * few["replicas"] <= many["result"]["replicas"] <= 10 * few["replicas"]
    result = many["result"]
    assert result["usd_per_m_tokens"] == pytest.approx(2.5 / (result["tokens_per_s"] * 3600) * 1e6)
    assert result["usd_per_m_output_tokens"] == pytest.approx(2.5 / (result["output_tokens_per_s"] * 3600) * 1e6)
    priced = plan_json(capsys, *base, "--users", "100000", "--gpu-hour-usd", "5")["result"]
    assert priced["usd_per_m_tokens"] == pytest.approx(2 * few["usd_per_m_tokens"])


def test_a_gpu_without_measured_step_times_asks_for_them(capsys, llama_8b):
    code, _, err = run_plan(capsys, "--model", llama_8b, "--gpu", "h200", *USERS)
    assert code == 2
    assert "no per-batch step times for --gpu h200" in err and "--measure" in err and "--curve" in err


def test_a_curve_of_another_model_is_refused_unless_allowed(capsys, tiny_model):
    code, _, err = run_plan(capsys, "--model", tiny_model, "--gpu", "h100", *USERS)
    assert code == 2 and "hidden_size 4096 vs 64" in err and "--allow-other-model-curve" in err
    doc = plan_json(capsys, "--model", tiny_model, "--gpu", "h100", *USERS, "--allow-other-model-curve")
    assert any("not this model's" in w for w in doc["warnings"])


@pytest.mark.parametrize("argv, flag", [
    (["--gpu", "h9"], "--gpu"),
    (["--gpu", "h100", "--users", "0"], "--users"),
    (["--gpu", "h100", "--turns-per-day", "-3"], "--turns-per-day"),
    (["--gpu", "h100", "--model", "/no/such/model"], "--model"),
    (["--model", "TINY"], "--gpu"),
    (["--gpu", "h100", "--quantization", "int8"], "--quantization"),
])
def test_bad_inputs_exit_2_naming_the_flag(capsys, tiny_model, argv, flag):
    argv = [tiny_model if a == "TINY" else a for a in argv]
    given = {a for a in argv if a.startswith("--")}
    defaults = [a for pair in (("--users", "10"), ("--turns-per-day", "5"), ("--model", tiny_model))
                if pair[0] not in given for a in pair]
    code, _, err = run_plan(capsys, *argv, *defaults)
    assert code == 2
    assert flag in err


def test_md1_wait_matches_erlang_and_simulation():
    assert md1_wait_cdf(0.0, 0.5, 1.0) == pytest.approx(0.5)  # no wait with probability 1 - rho
    assert md1_wait_quantile(0.95, 0.5, 1.0) == pytest.approx(2.05, abs=0.02)  # 2.048 in a 400,000-arrival simulation
    assert md1_wait_quantile(0.95, 1.0, 1.0) == float("inf")


def test_a_curve_file_is_read_back_and_interpolated_linearly(tiny_curve):
    curve = read_curve(tiny_curve)
    assert curve.max_batch == 256
    assert curve.step_seconds(36, 512, 256) == pytest.approx((12 + (20 - 12) * 28 / 56) / 1e3)
    assert curve.step_seconds(1, 1280, 256) == pytest.approx(10.5e-3)  # halfway between the two contexts
    with pytest.raises(ValueError, match="outside"):
        curve.step_seconds(257, 512, 256)


@pytest.mark.slow
def test_measure_times_the_demo_model_here_and_plans_with_it(capsys, tmp_path):
    saved = tmp_path / "curve.json"
    doc = plan_json(capsys, "--model", "demo", "--measure", "--users", "50", "--turns-per-day", "10", "--prompt-tokens", "64",
                    "--output-tokens", "16", "--measure-batches", "1,16", "--measure-contexts", "32,256",
                    "--measure-steps", "3", "--no-compile", "--tpot", "5", "--ttft-p95", "30", "--save-curve", str(saved))
    steps = {(p["batch"], p["context"]): p["step_ms"] for p in doc["curve"]["decode"]}
    assert steps[(16, 256)] > steps[(1, 256)]
    assert doc["device"]["kind"] == "cpu" and doc["curve"]["device"].startswith("CPU")
    assert doc["result"]["replicas"] >= 1
    assert read_curve(str(saved)).max_batch == 16
