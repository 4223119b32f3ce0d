"""Log formatting: plain text or one JSON object per line; fields passed as `extra=` are kept."""

from __future__ import annotations

import logging

import orjson

_STANDARD = set(vars(logging.makeLogRecord({}))) | {"message", "asctime"}


class Formatter(logging.Formatter):
    """Adds a record's extra fields: as `key=value` in text, as keys in JSON."""

    def __init__(self, as_json: bool = False) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")
        self.as_json = as_json

    def format(self, record: logging.LogRecord) -> str:
        extras = {k: v for k, v in vars(record).items() if k not in _STANDARD}
        if self.as_json:
            entry = {"time": self.formatTime(record), "level": record.levelname, "logger": record.name, "message": record.getMessage(), **extras}
            if record.exc_info:
                entry["traceback"] = self.formatException(record.exc_info)
            return orjson.dumps(entry, default=str).decode()
        text = super().format(record)
        if extras:
            text += " " + " ".join(f"{k}={v}" for k, v in extras.items())
        return text


def setup_logging(as_json: bool = False, level: int = logging.INFO) -> None:
    """Configure the root logger once for the whole process."""
    handler = logging.StreamHandler()
    handler.setFormatter(Formatter(as_json))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
