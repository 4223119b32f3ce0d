"""Keep-alive comments on idle streams: an SSE comment on a stream whose writer has waited
[server] heartbeat_seconds for its next delta, so proxies and clients keep the connection open.
One timer (`Heartbeats`, one a server) looks at every open stream; a stream's `Heartbeat` only
notes when it last sent something and whether it is waiting."""

from __future__ import annotations

import asyncio

from aiohttp import web

from chatd.http.server.state import ServerState
from chatd.http.server.wire import SlowClient, drop_slow_client, send, writable_now, write_now


class Heartbeat:
    """An SSE comment on a stream whose writer has waited `seconds` for its next delta (`idle`),
    keeping the connection alive. No timer of its own: the server's `Heartbeats` looks at every
    stream a few times a `seconds` (a task and a timer a stream cost ~50 us of each request). A
    client that cannot take the comment ends the writer's wait."""

    COMMENT = b": keep-alive\n\n"

    def __init__(self, state: ServerState, request: web.Request, response: web.StreamResponse) -> None:
        self.request, self.response = request, response
        self._writer = asyncio.current_task()
        self._sending: asyncio.Task | None = None  # a comment to a client that is behind, waiting for it
        self._beats = Heartbeats.of(state)
        self.idle, self.since = False, self._beats.loop.time()  # since: the last delta (or comment)
        self._beats.add(self)

    def waiting(self, idle: bool) -> None:
        self.idle = idle
        if not idle:
            self.since = self._beats.loop.time()

    def sent(self) -> None:
        """A delta went out while the writer waited: the idle time starts again."""
        self.since = self._beats.loop.time()

    def stop(self) -> None:
        self._beats.remove(self)
        if self._sending is not None:
            self._sending.cancel()

    def beat(self, now: float) -> None:
        self.since = now
        if writable_now(self.request):
            write_now(self.request, self.response, self.COMMENT)
        elif self._sending is None:
            self._sending = asyncio.create_task(self._send(), name="heartbeat")

    async def _send(self) -> None:
        try:
            await send(self.request, self.response, self.COMMENT)
        except SlowClient as exc:
            drop_slow_client(self.request, exc)
            self._writer.cancel()
        except ConnectionError:
            self._writer.cancel()
        finally:
            self._sending = None


class Heartbeats:
    """One timer for every stream's `Heartbeat` of a server: every quarter of [server]
    heartbeat_seconds, a comment to each stream idle for that long (so after 1-1.25 times it). It
    runs while a stream is open."""

    def __init__(self, seconds: float) -> None:
        self.seconds, self.loop = seconds, asyncio.get_running_loop()
        self.streams: dict[Heartbeat, None] = {}  # (an ordered set)
        self._task: asyncio.Task | None = None

    @classmethod
    def of(cls, state: ServerState) -> Heartbeats:
        beats = state.heartbeats
        if beats is None:
            state.heartbeats = beats = cls(state.heartbeat_seconds)
        return beats

    def add(self, beat: Heartbeat) -> None:
        self.streams[beat] = None
        if self._task is None:
            self._task = self.loop.create_task(self._run(), name="heartbeats")

    def remove(self, beat: Heartbeat) -> None:
        self.streams.pop(beat, None)
        if not self.streams and self._task is not None:  # it ends with the last stream (a stopping server
            self._task.cancel()                          # waits for no sleeping timer); the next starts it again
            self._task = None

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.seconds / 4)
            now = self.loop.time()
            for beat in [b for b in self.streams if b.idle and now - b.since >= self.seconds]:
                beat.beat(now)
