"""The ledger: the writes that bill (usage events, finished conversation replies), kept in memory
in order and written in the background until the store takes them.

A caller on the event loop hands a write over without waiting. When the file or the disk is
full, the write stays queued, `healthy` turns False (the HTTP layer then refuses new work with
503 and `retry_after`), and the queue is retried every `retry_seconds`; with nothing queued, a
probe checks whether the file takes writes again. At stop, a write that still cannot be made is
logged in full, so that the operator can bill it by hand. Usage events queued together are
written together, in one transaction (all or none): at hundreds of requests a second one write
each cost the event loop a round trip to the store's thread per request. It knows nothing of HTTP.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import math
import sqlite3
import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

import orjson

from chatd.store.db import Store, StoreUnavailableError, check_status
from chatd.store.messages import Call

log = logging.getLogger(__name__)

# The most usage events one transaction writes (Ledger._usage_batch).
BATCH = 256

# SQLite's primary result codes that mean "this write cannot be made now; the same write may
# succeed later": a full disk or file, an I/O error, another process holding the file, a file
# made read-only or moved away. Anything else is a bug, and retrying would not mend it.
_CANNOT_WRITE_NOW = {sqlite3.SQLITE_FULL, sqlite3.SQLITE_IOERR, sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED,
                     sqlite3.SQLITE_READONLY, sqlite3.SQLITE_CANTOPEN, sqlite3.SQLITE_PROTOCOL}


def cannot_write_now(exc: BaseException) -> bool:
    """Whether a store error means the file cannot take writes now (full, I/O, locked), not a bug.
    (PostgreSQL's such errors come as StoreUnavailableError: postgres.py sorts them.)"""
    if isinstance(exc, OSError | StoreUnavailableError):
        return True
    code = getattr(exc, "sqlite_errorcode", None)  # the extended code; its low byte is the primary one
    return isinstance(exc, sqlite3.OperationalError) and code is not None and code & 0xFF in _CANNOT_WRITE_NOW


@dataclass(frozen=True)
class UsageWrite:
    """A usage event waiting to be written, stamped when it was recorded."""

    tenant_id: str
    endpoint: str
    model: str
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    cost: float
    conversation_id: str | None
    message_id: str | None
    created_at: float

    kind = "usage event"

    async def apply(self, store: Store) -> None:
        """Write it."""
        fields = dict(vars(self))  # its fields, all plain values (dataclasses.asdict copies deeply: slower)
        await store.record_usage(fields.pop("tenant_id"), **fields)


@dataclass(frozen=True)
class ReplyWrite:
    """A finished conversation reply and its usage, waiting to be written."""

    tenant_id: str
    message_id: str
    content: str
    status: str
    finish_reason: str | None
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    cost: float
    model: str
    endpoint: str  # the usage event's: "conversations" or "responses"
    finished_at: float
    token_ids: tuple[int, ...] | None = None  # the reply's tokens as generated
    calls: tuple[Call, ...] = ()  # the tool calls it made

    kind = "finished reply"

    async def apply(self, store: Store) -> None:
        """Write it; a reply whose conversation was purged meanwhile is done (its usage is still recorded)."""
        fields = dataclasses.asdict(self)
        with contextlib.suppress(LookupError):
            await store.finish_turn(fields.pop("tenant_id"), fields.pop("message_id"), **fields)


class Ledger:
    """Usage events and finished replies, written in order in the background, kept until written."""

    def __init__(self, store: Store, *, retry_seconds: float, clock: Callable[[], float] = time.time,
                 sleep: Callable[[float], Awaitable[object]] = asyncio.sleep) -> None:
        if retry_seconds <= 0:
            raise ValueError(f"retry_seconds must be positive, got {retry_seconds}")
        self._store = store
        self._retry_seconds = retry_seconds
        self._clock = clock
        self._sleep = sleep
        # Each queued write, with the future its caller may await: True once written, False once
        # it could not be written now (it stays queued) or was dropped.
        self._pending: deque[tuple[UsageWrite | ReplyWrite, asyncio.Future[bool]]] = deque()
        self._work = asyncio.Event()  # a write was queued or a failure reported
        self._retry_now = asyncio.Event()  # stop() cuts the wait before the next retry short
        self._drained = asyncio.Event()
        self._drained.set()
        self._healthy = asyncio.Event()
        self._healthy.set()
        self._stopping = False
        self._task: asyncio.Task | None = None
        self.last_error: str | None = None  # the latest write failure, kept after recovery for diagnosis
        self.last_error_kind: str | None = None  # its exception's name, which names no address (for /health)

    @property
    def healthy(self) -> bool:
        """False from a failed write until a write (or, with nothing queued, a probe) succeeds."""
        return self._healthy.is_set()

    @property
    def retry_after(self) -> int:
        """Seconds a refused client should wait: the retry interval, rounded up, at least 1."""
        return max(1, math.ceil(self._retry_seconds))

    @property
    def num_pending(self) -> int:
        """Writes queued and not yet written (the one being written included)."""
        return len(self._pending)

    # --- the writes ---

    def record_usage(self, tenant_id: str, *, endpoint: str, model: str, prompt_tokens: int, cached_tokens: int,
                     completion_tokens: int, cost: float, conversation_id: str | None = None,
                     message_id: str | None = None) -> asyncio.Future[bool]:
        """Queue a usage event (as Store.record_usage), stamped now; returns at once, with a future
        that is True once it is written and False once it cannot be written now (it stays queued)."""
        return self._queue(UsageWrite(tenant_id, endpoint, model, prompt_tokens, cached_tokens, completion_tokens, cost,
                                      conversation_id, message_id, self._clock()))

    def finish_turn(self, tenant_id: str, message_id: str, *, content: str, status: str, finish_reason: str | None,
                    prompt_tokens: int, cached_tokens: int, completion_tokens: int, cost: float,
                    model: str, endpoint: str = "conversations",
                    token_ids: Sequence[int] | None = None, calls: Sequence[Call] = ()) -> asyncio.Future[bool]:
        """Queue a finished reply with its usage (as Store.finish_turn), stamped now; returns at once,
        with a future as record_usage's. ValueError at once for a status outside db.STATUSES."""
        check_status(status)  # the caller's bug, told to it now rather than logged later
        return self._queue(ReplyWrite(tenant_id, message_id, content, status, finish_reason, prompt_tokens, cached_tokens,
                                      completion_tokens, cost, model, endpoint, self._clock(),
                                      tuple(token_ids) if token_ids else None, tuple(calls)))

    def report_failure(self, exc: BaseException) -> None:
        """Another write failed (a turn's start, say): if it means the store cannot write now, the
        ledger turns unhealthy until a retry succeeds. Any other error is ignored: it is a bug
        for its caller to log, and says nothing about the file."""
        if cannot_write_now(exc):
            self._fail(exc)
            self._work.set()

    # --- running ---

    def start(self) -> None:
        """Start writing in the background (writes queued before are written first)."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="ledger")
            self._task.add_done_callback(_log_crash)

    async def stop(self, timeout: float) -> None:
        """Write what can be written within `timeout` seconds (retrying at once, then every
        retry_seconds); then log each write still pending, in full, and their count."""
        if self._task is not None:
            self._retry_now.set()  # the disk may have room by now: no need to wait for the next retry
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._drained.wait(), timeout)
            self._stopping = True
            self._work.set()
            self._retry_now.set()
            # The loop ends after the write in flight, if any. Cancelling that write could let it
            # commit unseen and then be logged as unwritten: billed twice.
            await asyncio.wait([self._task])
            self._task = None
        self._stopping = True
        for write, written in self._pending:
            log.error("unwritten %s, bill it by hand: %s", write.kind, _json(write))
            _settle(written, False)
        if self._pending:
            log.error("%d billing writes could not be saved to %s; each is logged above", len(self._pending),
                      self._store.path)
        self._pending.clear()
        self._drained.set()

    async def drained(self) -> None:
        """Wait until nothing is pending (each write written, dropped as a bug, or logged at stop)."""
        await self._drained.wait()

    async def wait_healthy(self) -> None:
        """Wait until the store takes writes."""
        await self._healthy.wait()

    # --- inside ---

    def _queue(self, write: UsageWrite | ReplyWrite) -> asyncio.Future[bool]:
        written = asyncio.get_running_loop().create_future()
        if self._stopping:  # a caller that outlived stop(): the write cannot be made, but must not vanish
            log.error("unwritten %s (the ledger was stopped), bill it by hand: %s", write.kind, _json(write))
            written.set_result(False)
            return written
        if not self.healthy:  # it waits behind the retries: its caller need not
            written.set_result(False)
        self._pending.append((write, written))
        self._drained.clear()
        self._work.set()
        return written

    async def _run(self) -> None:
        while not self._stopping:
            if self.healthy and not self._pending:
                await self._work.wait()
                self._work.clear()
                continue
            if not self.healthy:
                await self._pause()  # a failed write is tried again after retry_seconds, not at once
                if self._stopping:
                    break
            await self._attempt()

    async def _pause(self) -> None:
        """Wait retry_seconds, or less when stop() asks for a try now."""
        sleeper = asyncio.ensure_future(self._sleep(self._retry_seconds))
        interrupt = asyncio.ensure_future(self._retry_now.wait())
        try:
            await asyncio.wait({sleeper, interrupt}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            sleeper.cancel()
            interrupt.cancel()
        self._retry_now.clear()

    async def _attempt(self) -> None:
        """Write what is pending, in order, up to the first write that cannot be made now; with
        nothing pending, probe whether the file takes writes."""
        if not self._pending:
            try:
                await self._store.probe_write()
            except Exception as exc:  # whatever it is, the file is not known to take writes
                self._fail(exc)
            else:
                self._recover()
            return
        singly = 0  # after a batch failed for one bad write: this many go one at a time, to drop only that one
        while self._pending and not self._stopping:  # stop() has waited long enough: log the rest
            batch = self._usage_batch() if not singly else []
            if len(batch) > 1:
                try:
                    await self._store.record_usages([dict(vars(write)) for write, _ in batch])
                except Exception as exc:
                    if cannot_write_now(exc):
                        self._fail(exc)
                        return
                    singly = len(batch)
                    continue
                for _, written in batch:
                    self._pending.popleft()
                    _settle(written, True)
                self._recover()
                continue
            singly = max(singly - 1, 0)
            write, written = self._pending[0]
            try:
                await write.apply(self._store)
            except Exception as exc:
                if cannot_write_now(exc):
                    self._fail(exc)
                    return
                # A bug (a constraint, a bad value): the same write would fail forever and hold
                # back every write queued after it, so it is dropped, with all it would have billed.
                log.error("dropped %s that failed (%s: %s), bill it by hand: %s", write.kind, type(exc).__name__,
                          exc, _json(write))
                self._pending.popleft()
                _settle(written, False)
                continue
            self._pending.popleft()
            _settle(written, True)
            self._recover()
        if not self._pending:
            self._drained.set()

    def _usage_batch(self) -> list[tuple[UsageWrite, asyncio.Future[bool]]]:
        """The usage events at the head of the queue, up to the first other write (or BATCH): one
        transaction writes them, where one each cost the event loop a round trip per request."""
        batch = []
        for item in self._pending:
            if not isinstance(item[0], UsageWrite) or len(batch) == BATCH:
                break
            batch.append(item)
        return batch

    def _fail(self, exc: BaseException) -> None:
        for _, written in self._pending:  # nobody waits for a write that waits for the disk
            _settle(written, False)
        self.last_error = f"{type(exc).__name__}: {exc}"
        self.last_error_kind = type(exc).__name__
        if self.healthy:  # once per outage, not at every retry
            log.error("the store cannot write (%s): new work is refused, billing writes are kept in memory "
                      "and retried every %g s", self.last_error, self._retry_seconds)
        self._healthy.clear()

    def _recover(self) -> None:
        if not self.healthy:
            log.warning("the store writes again (%d billing writes still queued)", len(self._pending))
            self._healthy.set()


def _settle(written: asyncio.Future[bool], outcome: bool) -> None:
    if not written.done():
        written.set_result(outcome)


def _log_crash(task: asyncio.Task) -> None:
    """A bug in the writer loop stops all billing writes: say so at once, not at stop."""
    if not task.cancelled() and task.exception() is not None:
        log.error("the ledger's writer stopped: billing writes are no longer saved", exc_info=task.exception())


def _json(write: UsageWrite | ReplyWrite) -> str:
    fields = dataclasses.asdict(write)
    fields.pop("token_ids", None)  # the text and the usage are what an operator reconciles; ids only speed up a next turn
    if not fields.get("calls", True):
        fields.pop("calls")  # a reply that made no tool calls
    return orjson.dumps(fields).decode()
