"""The request log: one JSON line per finished request, through the standard logging machinery."""

from __future__ import annotations

import json
import logging
import logging.handlers
import queue
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engines.observability.request_timing import RequestRecord

LOGGER_NAME = "tandem.requests"
RECORD_ATTRIBUTE = "tandem_request"  # the LogRecord attribute carrying the RequestRecord


@dataclass(frozen=True, slots=True)
class RequestLogSettings:
    """Where the lines go (a rotated file, stdout, both or neither) and whether prompts do."""

    path: Path | None = None
    stdout: bool = False
    max_bytes: int = 10 * 1024 * 1024
    backups: int = 5
    include_prompt: bool = False

    @property
    def enabled(self) -> bool:
        return self.path is not None or self.stdout


class JsonLineFormatter(logging.Formatter):
    """Turns the RequestRecord a log record carries into one JSON line (on the listener thread,
    so neither JSON nor decoding a prompt costs the scheduler a step)."""

    def __init__(self, decode_prompt: Callable[[str, tuple[int, ...]], str] | None) -> None:
        super().__init__()
        self._decode_prompt = decode_prompt

    def format(self, record: logging.LogRecord) -> str:
        request: RequestRecord | None = getattr(record, RECORD_ATTRIBUTE, None)
        if request is None:
            return json.dumps({"message": record.getMessage()})
        line: dict[str, Any] = request.to_dict()
        if self._decode_prompt is not None:
            try:
                line["prompt"] = self._decode_prompt(request.model, request.prompt_token_ids)
            except Exception as error:  # a prompt that fails to decode still leaves its line
                line["prompt_error"] = str(error)
        return json.dumps(line, separators=(",", ":"))


class RequestLog:
    """A queue handler on the `tandem.requests` logger, drained by a listener thread."""

    def __init__(self, settings: RequestLogSettings, tokenizer: Callable[[str], Any]) -> None:
        """`tokenizer(model_id)`: the tokenizer that decodes that model's prompts."""
        self.settings = settings
        self._handlers: list[logging.Handler] = []
        if settings.path is not None:
            settings.path.parent.mkdir(parents=True, exist_ok=True)
            self._handlers.append(
                logging.handlers.RotatingFileHandler(
                    settings.path,
                    maxBytes=settings.max_bytes,
                    backupCount=settings.backups,
                    encoding="utf-8",
                )
            )
        if settings.stdout:
            self._handlers.append(logging.StreamHandler(sys.stdout))
        decode = None
        if settings.include_prompt:
            decode = lambda model, ids: tokenizer(model).decode(list(ids))  # noqa: E731
        for handler in self._handlers:
            handler.setFormatter(JsonLineFormatter(decode))
        self._queue: queue.SimpleQueue[logging.LogRecord] = queue.SimpleQueue()
        self._queue_handler = logging.handlers.QueueHandler(self._queue)
        self._listener = logging.handlers.QueueListener(self._queue, *self._handlers)
        self.logger = logging.getLogger(LOGGER_NAME)
        self.logger.propagate = False  # request lines never end up in the server log
        self.logger.setLevel(logging.INFO)
        self.logger.addHandler(self._queue_handler)
        self._listener.start()

    def write(self, record: RequestRecord) -> None:
        """A request listener (scheduler thread): hand the record over, nothing more."""
        self.logger.info("request %s", record.request_id, extra={RECORD_ATTRIBUTE: record})

    def close(self) -> None:
        """Write what is queued, then close the file."""
        self.logger.removeHandler(self._queue_handler)
        self._listener.stop()
        for handler in self._handlers:
            handler.close()
