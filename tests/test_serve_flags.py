"""`chatd --version` and the flags of `chatd serve` that vLLM's, Ollama's and llama.cpp's users
expect (cli.py): each lands in its config setting over the config file, --api-key wins over
CHATD_API_KEY, and a bad value is refused with a message naming the flag or setting. The
server itself is replaced by a recorder; tests/http/ runs the settings in a real server."""

from __future__ import annotations

import importlib.metadata
import logging
import subprocess
import sys

import pytest

import chatd.http.serve
from chatd.cli import build_parser, main, serve_config
from chatd.config_loader import build_config

KEY = "sk-local-0123456789"


@pytest.fixture
def served(monkeypatch) -> list:
    """The configs `chatd serve` would have served, in order; logging is restored afterwards."""
    configs = []

    async def record(config, reload_config=None) -> None:
        configs.append(config)
        assert reload_config() == config  # SIGHUP reads the same file, with the same flags over it

    monkeypatch.setattr(chatd.http.serve, "serve", record)
    root = logging.getLogger()
    monkeypatch.setattr(root, "handlers", list(root.handlers))
    monkeypatch.setattr(root, "level", root.level)
    monkeypatch.delenv("CHATD_API_KEY", raising=False)
    return configs


def test_version_prints_the_installed_version_and_exits_0():
    done = subprocess.run([sys.executable, "-m", "chatd", "--version"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"chatd {importlib.metadata.version('chatd')}"


def test_importing_the_cli_loads_no_load_generator():
    # A fresh interpreter: this test process has imported chatd.bench already. Only `chatd bench` needs it.
    code = "import sys, chatd.cli; print('chatd.bench' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == "False"


def test_bench_help_lists_its_flags():
    done = subprocess.run([sys.executable, "-m", "chatd", "bench", "--help"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage: chatd bench") and "--concurrency" in done.stdout


def test_serve_flags_land_in_their_settings(served):
    assert main(["serve", "--served-model-name", "qwen3-8b", "gpt-4o-mini", "--max-model-len", "512",
                 "--dtype", "bfloat16", "--log-level", "error", "--api-key", KEY, "--tool-call-parser", "mistral",
                 "--kv-cache-dtype", "fp8_e4m3", "--host-kv-cache-gb", "2.5", "-tp", "8", "--quantization", "int4",
                 "--no-compile"]) == 0
    [config] = served
    assert (config.model.tensor_parallel_size, config.model.quantization) == (8, "int4")
    assert config.model.compile is False
    assert (config.cache.kv_cache_dtype, config.cache.host_kv_cache_gb) == ("fp8_e4m3", 2.5)
    assert config.model.tool_parser == "mistral"
    assert config.server.model_name == ("qwen3-8b", "gpt-4o-mini")
    assert (config.model.max_model_len, config.model.dtype, config.server.log_level) == (512, "bfloat16", "error")
    assert config.auth.api_key == KEY and not config.auth.enabled
    assert logging.getLogger().level == logging.ERROR
    assert KEY not in repr(config)  # a config printed in a log or a traceback does not show the key


def test_model_repeated_as_name_equals_path_serves_several_models_and_the_admin_key_comes_from_the_environment(
        served, monkeypatch):
    monkeypatch.setenv("CHATD_ADMIN_KEY", "operator-secret")
    assert main(["serve", "--model", "small=demo", "--model", "large=/models/qwen3-8b", "--device", "cpu"]) == 0
    [config] = served
    assert [(entry.names, entry.model.path, entry.model.device) for entry in config.fleet()] == [
        (("small",), "demo", "cpu"), (("large",), "/models/qwen3-8b", "cpu")]
    assert config.auth.admin_key == "operator-secret" and "operator-secret" not in repr(config)
    assert main(["serve", "--model", "demo"]) == 0  # one path, as always: the one model of [model]
    assert served[1].models == () and served[1].model.path == "demo"
    for flags, said in ((["--model", "demo", "--model", "x=y"], "give every model as NAME=PATH"),
                        (["--model", "demo", "--model", "other"], "to serve several models, name each")):
        with pytest.raises(SystemExit, match=said):
            main(["serve", *flags])


def test_flags_win_over_the_config_file_and_the_environment(tmp_path, monkeypatch):
    path = tmp_path / "config.toml"
    path.write_text('[server]\nmodel_name = "from-file"\nlog_level = "warning"\n[model]\nmax_model_len = 128\n'
                    'dtype = "float32"\n[auth]\napi_key = "file-key"\n')

    def config_of(*flags: str):
        return serve_config(build_parser().parse_args(["serve", "--config", str(path), *flags]))

    monkeypatch.delenv("CHATD_API_KEY", raising=False)
    from_file = config_of()
    assert from_file.server.model_name == ("from-file",) and from_file.model.max_model_len == 128
    assert (from_file.model.dtype, from_file.server.log_level, from_file.auth.api_key) == ("float32", "warning", "file-key")
    monkeypatch.setenv("CHATD_API_KEY", "env-key")
    assert config_of().auth.api_key == "env-key"
    flagged = config_of("--api-key", "flag-key", "--served-model-name", "a", "--max-model-len", "64", "--dtype", "auto",
                        "--log-level", "debug")
    assert flagged.auth.api_key == "flag-key"
    assert (flagged.server.model_name, flagged.model.max_model_len, flagged.model.dtype, flagged.server.log_level) == (
        ("a",), 64, "auto", "debug")


@pytest.mark.parametrize(("flags", "message"), [
    (["--dtype", "float8"], "argument --dtype: invalid choice: 'float8'"),
    (["--log-level", "verbose"], "argument --log-level: invalid choice: 'verbose'"),
    (["--max-model-len", "0"], "argument --max-model-len: must be at least 1, got 0"),
    (["--max-model-len", "4k"], "argument --max-model-len: must be a whole number, got '4k'"),
    (["--served-model-name"], "argument --served-model-name: expected at least one argument"),
    (["--tool-call-parser", "json"], "argument --tool-call-parser: invalid choice: 'json'"),
    (["--kv-cache-dtype", "fp8"], "argument --kv-cache-dtype: invalid choice: 'fp8'"),
    (["--host-kv-cache-gb", "-1"], "argument --host-kv-cache-gb: must be 0 or more, got -1"),
    (["--host-kv-cache-gb", "lots"], "argument --host-kv-cache-gb: must be a number, got 'lots'"),
    (["--speculative-config", '{"method": "ngram", "num_lookahead_slots": 2}'],
     "argument --speculative-config: unknown key 'num_lookahead_slots'; known: method, model, num_speculative_tokens"),
    (["--speculative-config", "{method: ngram}"], "argument --speculative-config: not valid JSON"),
    (["--speculative-config", '"ngram"'], "argument --speculative-config: must be a JSON object"),
    (["--speculative-config", '{"num_speculative_tokens": "3"}'],
     "argument --speculative-config: setting speculative.num_speculative_tokens must be int, got '3'"),
])
def test_bad_flag_values_exit_2_naming_the_flag(flags, message, served, capsys):
    with pytest.raises(SystemExit) as exited:
        main(["serve", *flags])
    assert exited.value.code == 2
    assert message in capsys.readouterr().err
    assert served == []


@pytest.mark.parametrize(("flags", "env", "message"), [
    (["--served-model-name", "a", "a"], None, "server.model_name names a model twice"),
    (["--served-model-name", "a", " "], None, "server.model_name takes non-empty names"),
    (["--api-key", "two words"], None, "auth.api_key (--api-key, CHATD_API_KEY) must be visible ASCII"),
    ([], "key\n", "auth.api_key (--api-key, CHATD_API_KEY) must be visible ASCII"),
    (["--speculative-config", '{"method": "eagle"}'], None, "speculative.method must be one of"),
    (["--speculative-config", '{"method": "draft_model"}'], None, "speculative.model must name the draft model"),
    (["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 0}'], None,
     "speculative.num_speculative_tokens must be 1 or more, got 0"),
])
def test_bad_settings_exit_2_naming_the_setting(flags, env, message, served, capsys, monkeypatch):
    if env is not None:
        monkeypatch.setenv("CHATD_API_KEY", env)
    assert main(["serve", *flags]) == 2
    assert message in capsys.readouterr().err
    assert served == []


def test_speculative_config_flag_lands_in_the_speculative_section(served, tmp_path):
    """vLLM's --speculative-config JSON: its keys are [speculative]'s settings, each over the config file's."""
    assert main(["serve", "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 5, '
                 '"prompt_lookup_min": 3, "prompt_lookup_max": 6, "disable_by_batch_size": 8}']) == 0
    spec = served[-1].speculative
    assert (spec.method, spec.model, spec.num_speculative_tokens) == ("ngram", "", 5)
    assert (spec.prompt_lookup_min, spec.prompt_lookup_max, spec.disable_by_batch_size) == (3, 6, 8)
    # A draft model alone means method draft_model, as in vLLM; an int is taken for a float setting.
    assert main(["serve", "--speculative-config", '{"model": "/models/draft", "draft_kv_cache_gb": 1}']) == 0
    spec = served[-1].speculative
    assert (spec.method, spec.model, spec.draft_kv_cache_gb) == ("draft_model", "/models/draft", 1.0)
    assert main(["serve"]) == 0 and served[-1].speculative.method == ""  # off unless asked for

    path = tmp_path / "config.toml"
    path.write_text('[speculative]\nmethod = "draft_model"\nmodel = "/models/draft"\nprompt_lookup_max = 7\n')
    assert main(["serve", "--config", str(path)]) == 0
    assert (served[-1].speculative.method, served[-1].speculative.model) == ("draft_model", "/models/draft")
    # The flag's method wins, the file's draft model goes with its method; the file's other settings stay.
    assert main(["serve", "--config", str(path), "--speculative-config", '{"method": "ngram"}']) == 0
    spec = served[-1].speculative
    assert (spec.method, spec.model, spec.prompt_lookup_max) == ("ngram", "", 7)
    assert main(["serve", "--config", str(path), "--speculative-config", '{"method": ""}']) == 0
    assert (served[-1].speculative.method, served[-1].speculative.model) == ("", "")


@pytest.mark.parametrize("command", [["generate", "hi"], ["chat"]])
def test_in_process_commands_take_the_speculative_config_flag_too(command, monkeypatch):
    """`generate` and `chat` load the engine here: the flag reaches its config as --quantization does."""
    import chatd.cli
    from chatd.engine import LLMEngine

    monkeypatch.setattr(LLMEngine, "from_config", staticmethod(lambda config: config))
    args = build_parser().parse_args([*command, "--speculative-config", '{"method": "ngram", "prompt_lookup_max": 5}'])
    config = chatd.cli._load_engine(args)
    assert (config.speculative.method, config.speculative.prompt_lookup_max) == ("ngram", 5)


def test_a_shared_key_and_the_key_database_are_refused_together(tmp_path, served, capsys, monkeypatch):
    path = tmp_path / "config.toml"
    path.write_text("[auth]\nenabled = true\n")
    monkeypatch.setenv("CHATD_API_KEY", KEY)
    assert main(["serve", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert "auth.enabled = true" in err and "auth.api_key" in err and "CHATD_API_KEY" in err
    assert KEY not in err
    monkeypatch.delenv("CHATD_API_KEY")
    assert main(["serve", "--config", str(path)]) == 0  # the key database alone is fine
    assert served[0].auth.enabled and not served[0].auth.api_key


def test_model_name_in_config_takes_one_name_or_a_list():
    assert build_config({"server": {"model_name": "qwen3-8b"}}).server.model_name == ("qwen3-8b",)
    assert build_config({"server": {"model_name": ""}}).server.model_name == ()  # the folder's name, as before
    both = build_config({"server": {"model_name": ["qwen3-8b", "Qwen/Qwen3-8B"]}})
    assert both.server.model_name == ("qwen3-8b", "Qwen/Qwen3-8B")
    with pytest.raises(ValueError, match="server.model_name must be a list of strings"):
        build_config({"server": {"model_name": ["qwen3-8b", 8]}})


def test_model_settings_are_checked_when_read():
    with pytest.raises(ValueError, match="model.dtype must be one of auto, float32, float16, bfloat16, got 'fp16'"):
        build_config({"model": {"dtype": "fp16"}})
    with pytest.raises(ValueError, match="model.max_model_len must be 0 .* got -1"):
        build_config({"model": {"max_model_len": -1}})
    with pytest.raises(ValueError, match="server.log_level must be one of debug, info, warning, error, got 'INFO'"):
        build_config({"server": {"log_level": "INFO"}})


def test_chatd_runs_from_a_checkout_without_installed_metadata(tmp_path):
    """`python -m chatd` from a checkout that was never installed, with only PYTHONPATH set (as
    gpu_session.sh runs one on the GPU machine): the version falls back to the source's."""
    import os
    import shutil
    from pathlib import Path

    import chatd

    checkout = tmp_path / "checkout"
    shutil.copytree(Path(chatd.__file__).parent, checkout / "chatd", ignore=shutil.ignore_patterns("__pycache__"))
    # The venv's other packages, without chatd's own metadata or its editable-install hook.
    site = next(Path(p) for p in sys.path if p.endswith("site-packages"))
    others = tmp_path / "site"
    others.mkdir()
    for entry in site.iterdir():
        if not entry.name.lower().startswith(("chatd", "__editable__")) and entry.suffix != ".pth":
            (others / entry.name).symlink_to(entry)
    env = {**os.environ, "PYTHONPATH": f"{checkout}{os.pathsep}{others}", "COLUMNS": "400"}  # argparse wraps at it
    for command in (["--version"], ["serve", "--help"]):
        done = subprocess.run([sys.executable, "-S", "-m", "chatd", *command], capture_output=True, text=True,
                              timeout=120, env=env, cwd=tmp_path)
        assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage: chatd serve")
    version = subprocess.run([sys.executable, "-S", "-m", "chatd", "--version"], capture_output=True, text=True,
                             timeout=120, env=env, cwd=tmp_path).stdout
    assert version.strip() == f"chatd {chatd.__version__} (from {checkout}, not installed)"


def test_serve_help_states_the_defaults_the_code_uses():
    """Each `(default ...)` in `chatd serve --help` is the config's own default for that flag."""
    import re

    from chatd.config import Config

    defaults = Config()
    expected = {
        "--host": defaults.server.host,
        "--port": str(defaults.server.port),
        "--async-scheduling": defaults.scheduler.async_scheduling,
        "--dtype": defaults.model.dtype,
        "--kv-cache-dtype": defaults.cache.kv_cache_dtype,
        "--host-kv-cache-gb": f"{defaults.cache.host_kv_cache_gb:g}",
        "--tool-call-parser": defaults.model.tool_parser,
        "--log-level": defaults.server.log_level,
        "--quantization": defaults.model.quantization,
        "--tensor-parallel-size": str(defaults.model.tensor_parallel_size),
        "--shutdown-grace-seconds": f"{defaults.server.shutdown_grace_seconds:g}",
    }
    serve = next(action for action in build_parser()._subparsers._group_actions[0].choices.items() if action[0] == "serve")[1]
    helps = {option: action.help for action in serve._actions for option in action.option_strings}
    for flag, value in expected.items():
        said = re.search(r"\(default:? ([^;:),]+)", helps[flag])
        assert said, f"{flag}'s help states no default: {helps[flag]!r}"
        assert said.group(1).split()[0] == value, f"{flag}'s help says default {said.group(1)!r}; the code uses {value!r}"
    assert "SmolLM2-135M-Instruct" in helps["--model"]  # what serves when no model is named
    from chatd.engine.models.sources import DEFAULT_MODEL_FILE

    assert DEFAULT_MODEL_FILE.startswith("SmolLM2-135M-Instruct")
