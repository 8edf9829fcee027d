"""Logging set-up driven by DYN_LOG, the way Dynamo's components read it.

DYN_LOG is a level (`debug`, `info`, `warn`, `error`, `trace`) optionally followed by per-logger
directives: `info,tandem.runtime.tcp=debug`. DYN_LOGGING_JSONL=1 switches to one JSON object per line.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time

_LEVELS = {
    "trace": logging.DEBUG,
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warn": logging.WARNING,
    "warning": logging.WARNING,
    "error": logging.ERROR,
    "off": logging.CRITICAL + 10,
}


def _level(name: str) -> int:
    try:
        return _LEVELS[name.strip().lower()]
    except KeyError:
        raise ValueError(f"DYN_LOG: unknown level {name!r}; use one of {', '.join(_LEVELS)}") from None


class _Seconds:
    """A record's time to the second, formatted once per second (a frontend logs a line per request)."""

    def __init__(self) -> None:
        self.second = -1
        self.text = ""

    def __call__(self, created: float) -> str:
        second = int(created)
        if second != self.second:
            self.text = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(second))
            self.second = second
        return self.text


_second = _Seconds()


class _TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        line = f"{_second(record.created)}.{int(record.msecs):03d}Z {record.levelname:<5} {record.name}: {record.getMessage()}"
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


class _JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "time": f"{_second(record.created)}.{int(record.msecs):03d}Z",
            "level": record.levelname,
            "target": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry)


def configure_logging(spec: str | None = None, *, jsonl: bool | None = None) -> None:
    """Install tandem's log handler on the root logger (idempotent)."""
    spec = spec if spec is not None else os.environ.get("DYN_LOG", "info")
    if jsonl is None:
        jsonl = os.environ.get("DYN_LOGGING_JSONL", "").lower() in ("1", "true", "yes", "on")
    parts = [p for p in spec.split(",") if p.strip()] or ["info"]
    root_level = logging.INFO
    per_logger: dict[str, int] = {}
    for part in parts:
        if "=" in part:
            name, level = part.split("=", 1)
            per_logger[name.strip()] = _level(level)
        else:
            root_level = _level(part)
    root = logging.getLogger()
    for handler in list(root.handlers):
        if getattr(handler, "_tandem", False):
            root.removeHandler(handler)
    handler = logging.StreamHandler(sys.stderr)
    handler._tandem = True  # type: ignore[attr-defined]
    handler.setFormatter(_JsonFormatter() if jsonl else _TextFormatter())
    root.addHandler(handler)
    root.setLevel(root_level)
    for logger_name, logger_level in per_logger.items():
        logging.getLogger(logger_name).setLevel(logger_level)


def lean_records() -> None:
    """Log records without their caller's file and line, thread and process, which tandem's formats do not
    print: a process that logs a line per request (the frontend) skips a walk of the stack per line. Not for
    processes whose libraries log with formats of their own (vLLM prints the file and line)."""
    logging._srcfile = None  # type: ignore[attr-defined]
    logging.logThreads = logging.logProcesses = logging.logMultiprocessing = False
