"""Log lines of every pagebus process: one line per event on stderr, as text or as JSON.

Each line carries the time, the level, the process (`http-0`, `scheduler-0`, `worker-0`, ...), the
logger and, inside a request's task, the request id (`request_id_var`). JSON lines are one object
each, encoded by the json module, so journald and log shippers read them without a parser of ours.
Known secrets (the API key) are replaced by `***` in every line, whatever logged them.
`bus.proc.spawn` hands the format on to each child it starts.
"""

from __future__ import annotations

import contextvars
import datetime
import json
import logging
import sys
from typing import Any, Literal

LogFormat = Literal["text", "json"]
LOG_FORMATS: tuple[LogFormat, ...] = ("text", "json")

request_id_var: contextvars.ContextVar[str | None] = contextvars.ContextVar("request_id", default=None)

_STANDARD = set(logging.makeLogRecord({}).__dict__) | {"message", "asctime", "taskName", "proc_tag"}
_state: dict[str, Any] = {"format": "text", "secrets": ()}


def current_format() -> LogFormat:
    fmt: LogFormat = _state["format"]
    return fmt


def set_secrets(secrets: list[str]) -> None:
    """Strings never to appear in a log line (replaced by ***); empty strings are ignored."""
    _state["secrets"] = tuple(s for s in secrets if s)


def _redact(text: str) -> str:
    for s in _state["secrets"]:
        text = text.replace(s, "***")
    return text


class _Context(logging.Filter):
    def __init__(self, tag: str) -> None:
        super().__init__()
        self.tag = tag

    def filter(self, record: logging.LogRecord) -> bool:
        record.proc_tag = self.tag
        if getattr(record, "request_id", None) is None:
            record.request_id = request_id_var.get()
        return True


class TextFormatter(logging.Formatter):
    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s [%(proc_tag)s pid=%(process)d] %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        rid = getattr(record, "request_id", None)
        if rid is not None:
            head, sep, rest = line.partition(": ")
            line = f"{head} [{rid}]{sep}{rest}"
        return _redact(line)


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time (UTC, ms), level, process, pid, logger, request_id, msg, then
    any `extra=` fields, and `exc` with the traceback when there is one."""

    def format(self, record: logging.LogRecord) -> str:
        when = datetime.datetime.fromtimestamp(record.created, tz=datetime.timezone.utc)
        out: dict[str, Any] = {
            "time": when.isoformat(timespec="milliseconds").replace("+00:00", "Z"),
            "level": record.levelname,
            "process": getattr(record, "proc_tag", None),
            "pid": record.process,
            "logger": record.name,
            "request_id": getattr(record, "request_id", None),
            "msg": _redact(record.getMessage()),
        }
        for k, v in record.__dict__.items():
            if k not in _STANDARD and k not in out:
                out[k] = v
        if record.exc_info:
            out["exc"] = _redact(self.formatException(record.exc_info))
        elif record.exc_text:
            out["exc"] = _redact(record.exc_text)
        return json.dumps(out, ensure_ascii=False, default=str)


def configure_logging(level: int | str, fmt: LogFormat, tag: str) -> None:
    """Replace the root logger's handlers with one stderr handler of the given format."""
    if fmt not in LOG_FORMATS:
        raise ValueError(f"log format must be one of {LOG_FORMATS}, got {fmt!r}")
    _state["format"] = fmt
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    handler.addFilter(_Context(tag))
    root = logging.getLogger()
    for h in root.handlers[:]:
        root.removeHandler(h)
        h.close()
    root.addHandler(handler)
    root.setLevel(level if isinstance(level, int) else level.upper())
    logging.captureWarnings(True)  # warnings become log lines too, not bare stderr text
