"""The server's start and stop as a probe and an operator see them: phases, answers, a timeline.

The port opens at once, before the model loads (seconds on a CPU, minutes for a big model on a
GPU): a liveness probe that gets no answer restarts a server that was only loading, and a client
that gets "connection refused" cannot tell a slow start from a dead server. While it starts, a
small app answers on the port (`starting_app`): `/live` 200 (the process runs), `/health` and
`/ready` 503 with the phase and `Retry-After` (a gateway sends it no traffic yet), every other
route 503 in OpenAI's error shape with `Retry-After`. Once the model serves, serve.py hands the
port to the full app.

`Startup` keeps the phases and the start timeline: seconds from the process's start to the port
opening, the model loaded, ready (the warm-up request done), the first token of a client's
request, and the compiled steps in use (CPU: they compile on a thread while eager steps serve,
worker/fast_steps/compile_job.py). Each is logged as it happens and the whole once everything is in.
"""

from __future__ import annotations

import logging
import os
import time

from aiohttp import web

from chatd.http.errors import error_response

log = logging.getLogger("chatd.http")

RETRY_AFTER_SECONDS = 5  # what a request refused while the server starts is told to wait
MARKS = ("listening", "loaded", "ready", "first token", "compiled")


def process_age() -> float:
    """Seconds since this process started (Linux: from /proc; elsewhere since chatd's import)."""
    try:
        with open("/proc/self/stat", "rb") as file:
            fields = file.read().rsplit(b")", 1)[1].split()
        started = int(fields[19]) / os.sysconf("SC_CLK_TCK")  # starttime, field 22: ticks after boot
        return time.clock_gettime(time.CLOCK_BOOTTIME) - started
    except (OSError, ValueError, IndexError, AttributeError):
        return time.monotonic() - _IMPORTED


_IMPORTED = time.monotonic()


class Startup:
    """The phase the server is in ("loading", "warming up", "serving", "draining") and its start
    timeline; `age` is injectable for tests."""

    def __init__(self, age=process_age) -> None:
        self.age = age
        self.phase = "loading"
        self.marks: dict[str, float] = {}
        self.timeline_logged = False

    def mark(self, name: str, note: str = "") -> None:
        """Record that `name` (one of MARKS) happened now, and log it; a mark is kept once."""
        if name in self.marks:
            return
        self.marks[name] = self.age()
        log.info("start: %s after %.1f s%s", name, self.marks[name], f" ({note})" if note else "")

    def timeline(self) -> str:
        """The marks so far, in order, as one line's worth."""
        return ", ".join(f"{name} {self.marks[name]:.1f} s" if name in self.marks else f"{name} -" for name in MARKS)

    def log_timeline(self) -> None:
        """The whole start timeline, once (benchmarks wait for this line: the server runs as it will)."""
        if not self.timeline_logged:
            self.timeline_logged = True
            log.info("start timeline: %s (seconds since the process started)", self.timeline())


STARTUP = web.AppKey("startup", Startup)


def starting_app(startup: Startup) -> web.Application:
    """What answers on the port while the model loads and warms up."""
    app = web.Application()
    app[STARTUP] = startup
    app.router.add_route("*", "/{path:.*}", _while_starting)
    return app


async def _while_starting(request: web.Request) -> web.Response:
    """Each answer closes its connection, so a client's next request reaches whichever app serves then."""
    startup = request.app[STARTUP]
    # A connection taken just before the hand-over whose request came after it (serve.py waits for
    # it): answered as the server was when it connected; its next connection reaches the full app.
    phase = startup.phase if startup.phase in ("loading", "warming up") else "warming up"
    headers = {"Retry-After": str(RETRY_AFTER_SECONDS)}
    probe = request.path if request.method in ("GET", "HEAD") else None
    if probe == "/live":
        answer = web.json_response({"status": "alive", "phase": phase})
    elif probe in ("/health", "/ready"):
        answer = web.json_response({"status": phase, "phase": phase}, status=503, headers=headers)
    else:
        answer = error_response(503, f"the server is starting ({phase} the model); retry in a few seconds",
                                None, "server_starting", headers=headers)
    answer.force_close()
    return answer
