"""Structured logs: one JSON object per line, through the standard `logging` module."""

from __future__ import annotations

import json
import logging
from pathlib import Path

from .counts import as_python

_STANDARD = set(vars(logging.makeLogRecord({}))) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):
    """`{"time", "level", "logger", "message", ...extra}` per record."""

    def format(self, record: logging.LogRecord) -> str:
        out = {
            "time": round(record.created, 3),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        for k, v in vars(record).items():
            if k not in _STANDARD and not k.startswith("_"):
                out[k] = v
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out, default=as_python)


class _RunLog(logging.FileHandler):
    """The run folder's log: when the folder stops taking writes (disk full, deleted), the
    store's error says so once; a traceback per log line would bury it."""

    def handleError(self, record: logging.LogRecord) -> None:  # noqa: N802 (logging's name)
        pass


def open_run_log(logger: logging.Logger, run_dir: Path) -> logging.Handler:
    """Send `logger`'s records to `run_dir/log.jsonl`; returns the handler to close later."""
    handler = _RunLog(run_dir / "log.jsonl", encoding="utf-8")
    handler.setFormatter(JsonFormatter())
    handler.setLevel(logging.INFO)
    logger.addHandler(handler)
    if logger.level == logging.NOTSET or logger.level > logging.INFO:
        logger.setLevel(logging.INFO)
    return handler
