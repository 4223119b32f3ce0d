"""The compile job's life (worker/fast_steps/compile_job.py): compiling while eager steps serve, the steps
handed to the runner once made, and a failure leaving every step eager with the reason logged.
Compiling for real through a server is tests/http/test_compiled_serve.py (slow: a minute of
inductor); here the runner's compile is stood in for, so the job's own rules run in milliseconds."""

from __future__ import annotations

import logging
import threading
from types import SimpleNamespace

import pytest

from chatd.engine.worker.fast_steps import compile_job
from chatd.engine.worker.fast_steps.compile_job import COMPILED, COMPILING, FAILED, CompileJob


@pytest.fixture(autouse=True)
def stand_in_compile(monkeypatch):
    monkeypatch.setattr(compile_job, "enable_compiled_steps", lambda runner, folder: runner.enable_compiled_steps(folder))


class Runner:
    """What the job touches of a ModelRunner: its model and fast steps' two compiled slots, and a
    stand-in for fast_steps.py's `enable_compiled_steps`."""

    def __init__(self, error: Exception | None = None) -> None:
        self.fast = SimpleNamespace(compiled=None, compiled_prefill=None)
        self.error = error
        self.release = threading.Event()
        self.requantized = 0
        # int8_blocks_per_row walks the model's modules once: a model of none.
        self.model = SimpleNamespace(modules=self._requantize, quantized_head=None)

    def _requantize(self) -> list:
        self.requantized += 1
        return []

    def enable_compiled_steps(self, folder) -> float:
        self.release.wait(10)
        if self.error is not None:
            raise self.error
        self.fast.compiled = SimpleNamespace(steps={1: None, 2: None}, read_back=1)
        self.fast.compiled_prefill = SimpleNamespace(min_tokens=192, halves={"layer": None}, read_back=0)
        return 0.0


def test_steps_are_handed_over_only_once_made_and_everyone_waiting_hears(tmp_path, caplog):
    runner = Runner()
    job = CompileJob(runner, tmp_path)
    heard = []
    job.on_done(lambda: heard.append(job.state))
    with caplog.at_level(logging.INFO, "chatd.engine"):
        job.start()
        assert job.wait(0.05) == COMPILING and runner.fast.compiled is None and heard == []  # eager steps serve meanwhile
        runner.release.set()
        assert job.wait(10) == COMPILED
    assert runner.fast.compiled is not None and runner.fast.compiled_prefill.min_tokens == 192
    assert heard == [COMPILED] and job.seconds is not None
    job.on_done(lambda: heard.append("late"))  # a listener after the end is told at once
    assert heard == [COMPILED, "late"]
    assert any("compiled steps in use" in r.getMessage() and "1 of 4 read back" in r.getMessage()
               for r in caplog.records)


def test_a_failed_compile_leaves_every_step_eager_and_says_why(tmp_path, caplog):
    runner = Runner(RuntimeError("no C++ compiler found\ndetails"))
    runner.release.set()
    job = CompileJob(runner, tmp_path)
    heard = []
    job.on_done(lambda: heard.append(job.state))
    with caplog.at_level(logging.WARNING, "chatd.engine"):
        job.start()
        assert job.wait(10) == FAILED
    assert runner.fast.compiled is None and runner.fast.compiled_prefill is None
    assert runner.requantized == 1  # eager decode steps need GGUF blocks a scale per row, as at an eager start
    assert heard == [FAILED]
    (warning,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert "RuntimeError: no C++ compiler found" in warning and "every step runs eagerly" in warning
