"""`chatd chat`, run as a real process: in-process and against a real `chatd serve`. Replies stream,
each turn resends the history, /reset forgets it, a failed turn or a stopped reply keeps the chat
alive, and Ctrl-C at the prompt or Ctrl-D quits with status 0. Last, `chatd serve --allowed-origins`
(cli.py, like the chat command)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from chatd.engine import Tokenizer
from chatd.engine.models.demo import build_demo_model
from tests.http.serving import create_key, start_server, stop_server

USAGE = re.compile(rb"\[(\d+) prompt tokens, (\d+) reply tokens\]")
PROMPT = b"\n> "
ENV = {**os.environ, "PYTHONIOENCODING": "utf-8"}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return build_demo_model(tmp_path_factory.mktemp("chat") / "demo")


@pytest.fixture(scope="module")
def server(tmp_path_factory, model_dir):
    """chatd serve with auth on, and a key for alice."""
    root = tmp_path_factory.mktemp("chat-server")
    config = f'[store]\ndb_path = "{root / "chatd.db"}"\n[auth]\nenabled = true\n[cache]\nnum_blocks = 512\n'
    (root / "config.toml").write_text(config)
    key = create_key(root / "config.toml", "alice")
    proc, url, _ = start_server(root, model_dir, config)
    yield {"url": url, "key": key}
    stop_server(proc)


def in_process_args(model_dir: Path, tmp_path: Path) -> list[str]:
    config = tmp_path / "config.toml"
    config.write_text("[cache]\nnum_blocks = 512\n")  # a small KV pool: it loads in a blink
    return ["--model", str(model_dir), "--device", "cpu", "--config", str(config)]


def url_args(server) -> list[str]:
    return ["--url", server["url"], "--api-key", server["key"]]


def run_chat(args: list[str], lines: list[str]) -> subprocess.CompletedProcess:
    """`chatd chat ARGS` with `lines` typed in, then the end of input."""
    typed = "".join(f"{line}\n" for line in lines).encode()
    return subprocess.run([sys.executable, "-m", "chatd", "chat", *args], input=typed, capture_output=True, timeout=120,
                          env=ENV)


def replies(stdout: bytes) -> list[tuple[bytes, int, int]]:
    """Each turn's streamed text with its prompt and reply token counts (from --verbose)."""
    turns = []
    for chunk in stdout.split(PROMPT)[1:]:
        match = USAGE.search(chunk)
        if match:
            turns.append((chunk[:match.start()].strip(), int(match.group(1)), int(match.group(2))))
    return turns


class ChatProcess:
    """A `chatd chat` process driven line by line while its output streams in."""

    def __init__(self, args: list[str], stderr_path: Path, ignore_ctrl_c: bool = False) -> None:
        # ignore_ctrl_c: started with SIGINT ignored, as a parent that ignores it leaves a child.
        ignoring = (lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)) if ignore_ctrl_c else None
        with open(stderr_path, "wb") as stderr:
            self.proc = subprocess.Popen([sys.executable, "-m", "chatd", "chat", *args], stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, stderr=stderr, env=ENV, preexec_fn=ignoring)
        self.stderr_path = stderr_path
        self.output = b""
        self.changed = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        while chunk := self.proc.stdout.read1(4096):
            with self.changed:
                self.output += chunk
                self.changed.notify_all()

    def send(self, line: str) -> int:
        """Type a line; returns where in the output its reply will begin."""
        with self.changed:
            mark = len(self.output)
        self.proc.stdin.write(f"{line}\n".encode())
        self.proc.stdin.flush()
        return mark

    def wait_for(self, done, what: str, timeout: float = 60) -> bytes:
        with self.changed:
            if not self.changed.wait_for(lambda: done(self.output), timeout):
                self.proc.kill()
                pytest.fail(f"chatd chat never showed {what}:\n{self.output[-2000:]!r}\n"
                            + self.stderr_path.read_text()[-3000:])
            return self.output

    def wait_for_prompt(self, after: int) -> bytes:
        return self.wait_for(lambda out: out.endswith(b"> ") and len(out) > after + 2, "the prompt")

    def exit_status(self) -> int:
        self.proc.stdin.close()
        status = self.proc.wait(timeout=30)
        assert "Traceback" not in self.stderr_path.read_text()
        return status


@pytest.mark.slow
def test_in_process_chat_streams_replies_and_resends_the_history(model_dir, tmp_path):
    done = run_chat([*in_process_args(model_dir, tmp_path), "--system", "Be brief.", "--verbose", "--temperature", "0",
                     "--max-tokens", "8"], ["hello there", "and again", "/reset", "hello there", "/exit"])
    assert done.returncode == 0, done.stderr[-3000:]
    (text1, prompt1, reply1), (text2, prompt2, _), (text3, prompt3, _) = replies(done.stdout)
    assert text1 and text2 and text3
    assert prompt2 > prompt1 + reply1  # the first turn, question and answer, came along with the second
    assert prompt3 == prompt1  # after /reset only the system prompt is left
    assert text3 == text1  # greedy: the same conversation, the same reply
    assert b"(history cleared)" in done.stdout


@pytest.mark.slow
def test_url_chat_sends_the_history_to_the_server(server):
    done = run_chat([*url_args(server), "--system", "Be brief.", "--verbose", "--temperature", "0", "--max-tokens", "8"],
                    ["hello there", "and again", "/reset", "hello there", "/exit"])
    assert done.returncode == 0, done.stderr[-3000:]
    (text1, prompt1, reply1), (text2, prompt2, _), (text3, prompt3, _) = replies(done.stdout)  # as the server counted
    assert text1 and text2 and text3
    assert prompt2 > prompt1 + reply1
    assert prompt3 == prompt1


@pytest.mark.slow
def test_a_refused_request_prints_the_server_error_and_the_chat_goes_on(server):
    done = run_chat(["--url", server["url"], "--api-key", "chatd_000000000000_wrong"], ["hello", "hello again"])
    assert done.returncode == 0, done.stderr[-3000:]  # Ctrl-D (the end of input) quits
    assert done.stdout.count(b"error: HTTP 401: invalid API key\n> ") == 2


def test_a_server_that_is_down_is_an_error_and_ctrl_c_at_the_prompt_quits(tmp_path):
    chat = ChatProcess(["--url", "http://127.0.0.1:9"], tmp_path / "stderr")
    chat.wait_for_prompt(0)
    mark = chat.send("hello")
    out = chat.wait_for_prompt(mark)
    assert b"error: request to http://127.0.0.1:9/v1/chat/completions failed" in out[mark:]
    chat.proc.send_signal(signal.SIGINT)
    assert chat.exit_status() == 0


@pytest.mark.slow
@pytest.mark.parametrize("mode, ignored", [("in-process", False), ("url", False),
                                           ("url", True)])  # started by a parent that ignores Ctrl-C
def test_ctrl_c_stops_a_reply_and_keeps_what_was_said(mode, ignored, model_dir, tmp_path, request):
    args = in_process_args(model_dir, tmp_path) if mode == "in-process" else url_args(request.getfixturevalue("server"))
    chat = ChatProcess([*args, "--verbose", "--temperature", "0", "--max-tokens", "400"], tmp_path / "stderr",
                       ignore_ctrl_c=ignored)
    chat.wait_for_prompt(0)
    mark = chat.send("hello there")  # greedy, the demo model answers this past 400 tokens
    chat.wait_for(lambda out: len(out) > mark + 20, "the reply streaming")
    chat.proc.send_signal(signal.SIGINT)
    out = chat.wait_for(lambda out: out.endswith(b"[reply stopped]\n> "), "the reply stopped")
    partial = out[mark:out.rindex(b"\n[reply stopped]")].decode()

    mark = chat.send("hi")
    out = chat.wait_for(lambda out: USAGE.search(out, mark), "the second reply")
    chat.send("/exit")
    assert chat.exit_status() == 0
    [(text, prompt_tokens, _)] = replies(out[mark - len(PROMPT):])
    assert text
    tokenizer = Tokenizer.from_pretrained(model_dir)
    history = [{"role": "user", "content": "hello there"}, {"role": "assistant", "content": partial},
               {"role": "user", "content": "hi"}]
    assert prompt_tokens == len(tokenizer.encode_chat(history))  # the stopped reply is what the assistant said


def test_serve_allowed_origins_flag_sets_the_config(monkeypatch, capsys):
    # Not chat, but the same command line (cli.py); the server itself is replaced by a recorder.
    import chatd.http.serve
    from chatd.cli import main

    served = []

    async def record(config, reload_config=None) -> None:
        served.append(config)

    monkeypatch.setattr(chatd.http.serve, "serve", record)
    assert main(["serve", "--allowed-origins", "https://chat.example.com, http://localhost:5173,"]) == 0
    assert served[0].server.allowed_origins == ("https://chat.example.com", "http://localhost:5173")
    assert main(["serve", "--allowed-origins", "chat.example.com"]) == 2
    assert "server.allowed_origins" in capsys.readouterr().err
