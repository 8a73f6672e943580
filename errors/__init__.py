"""The error hierarchy every tandem package raises; messages carry the values and what to do."""


class TandemError(Exception):
    """Base of every error tandem reports to a user (CLI: one line, API: OpenAI-shaped JSON)."""


class PlanError(TandemError):
    """A parallelism plan cannot be made or does not fit the cluster."""

    exit_status = 2  # `tandem serve` refusing to start because nothing fits


class ModelError(TandemError):
    """A model directory is missing, malformed, or unsupported."""


class PeerError(TandemError):
    """A peer failed to authenticate, answer, or stay alive."""


class ChannelError(PeerError):
    """A frame on an authenticated channel failed to open, parse, or arrive in time."""


class EngineError(TandemError):
    """An engine could not load, generate, or lost one of its ranks or stages."""


class QueueFullError(EngineError):
    """The request queue is full; the client should retry later (HTTP 429)."""


class OverloadedError(EngineError):
    """New requests are refused for now (a node's memory is critical); HTTP 503 with
    Retry-After: retry_after_s."""

    def __init__(self, message: str, retry_after_s: int) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class ConfigError(TandemError):
    """A flag, environment variable, or file given by the operator is invalid."""


class RequestError(TandemError):
    """A generation request's field is missing or outside its limits (API: a 400 naming it)."""

    SHOWN_CHARS = 40  # of the offending value, in the message

    def __init__(self, field: str, value: object, expected: str) -> None:
        shown = repr(value)
        if len(shown) > self.SHOWN_CHARS:
            shown = shown[: self.SHOWN_CHARS] + "..."
        super().__init__(f"{field} must be {expected}, got {shown}")
        self.field = field
        self.value = value
