"""One generation seen from the API: checked parameters, the GenerationRequest, a bounded wait."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from dataclasses import dataclass, fields

from engines.api.errors import APIError, engine_unavailable, generation_timeout, model_not_found
from engines.api.fields import check_fields, top_logprobs
from engines.api.logprobs import TokenScore
from engines.api.schemas import SamplingFields
from engines.core.engine import Failure, TokenEvent
from engines.core.request import GenerationRequest
from engines.core.runner import Submission
from engines.core.service import Service, ServiceLimits
from planner.errors import RequestError

log = logging.getLogger(__name__)

# The runner enforces request_timeout_s itself once a request runs; the API waits a little
# longer so the runner's own message wins, and a hung engine still cannot hold a client forever.
TIMEOUT_MARGIN_S = 1.0
DISCONNECT_POLL_S = 0.25
DEFAULT_TEMPERATURE = 1.0  # OpenAI's default when the field is omitted
CLIENT_CLOSED = 499  # nginx's status for "the client went away"
# request fields build_request makes itself; the others are copied from the body by name
BUILT_FIELDS = frozenset(
    {"request_id", "prompt_tokens", "max_tokens", "stop", "timeout_s", "logprobs", "grammar"}
)


class GenerationTimeout(Exception):
    """No final event arrived within the request's time budget."""


@dataclass(frozen=True, slots=True)
class Outcome:
    """A finished non-streaming generation."""

    text: str
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    scores: list[TokenScore]  # one per token, when the request asked for logprobs
    cached_tokens: int = 0


def check_supported(service: Service, body: SamplingFields) -> None:
    """What the schema cannot check: the model this server serves, n (one choice only), the
    fields the running engine cannot honour, and that a tokenizer is there (none until the
    first engine has loaded)."""
    if body.model != service.model_id:
        raise model_not_found(body.model, service.model_id)
    if body.n is not None and body.n != 1:
        message = f"only n=1 is supported, got n={body.n}"
        raise APIError(400, message, param="n", code="invalid_value")
    if service.tokenizer is None:
        reason = f": {service.state_reason}" if service.state_reason else ""
        raise engine_unavailable(f"the model is not loaded yet ({service.state}{reason})")
    runner = service.runner
    check_fields(body, runner.engine.features if runner is not None else frozenset())


def build_request(
    service: Service,
    request_id: str,
    body: SamplingFields,
    prompt_tokens: tuple[int, ...],
    context_tokens: int,
    grammar: str | None = None,
) -> GenerationRequest:
    """The engine-agnostic request, checked; prompt + max_tokens must fit the context the KV
    cache was planned for (an absent max_tokens shrinks to what is left); a request the running
    engine would refuse on its own (Engine.refusal) is a 400 here, before it queues."""
    given = {name: getattr(body, name) for name in _fields_by_name(body)}
    given = {name: value for name, value in given.items() if value is not None}
    given.setdefault("temperature", DEFAULT_TEMPERATURE)
    request = GenerationRequest(
        request_id=request_id,
        prompt_tokens=prompt_tokens,
        max_tokens=resolve_max_tokens(body, service.limits, context_tokens - len(prompt_tokens)),
        stop=body.stop_sequences(),
        timeout_s=service.limits.request_timeout_s,
        logprobs=top_logprobs(body),
        grammar=grammar,
        **given,
    )
    try:
        request.check()
    except RequestError as error:
        param = _param_of(error.field, body)
        raise APIError(400, str(error), param=param, code="invalid_value") from None
    runner = service.runner
    refusal = runner.engine.refusal(request) if runner is not None else None
    if refusal is not None:
        param = _param_of("grammar", body) if grammar is not None else None
        raise APIError(400, refusal, param=param, code="invalid_value")
    return request


def _fields_by_name(body: SamplingFields) -> list[str]:
    """The request's fields the body carries under the same name and meaning: copied as they
    are (an absent one keeps the request's default)."""
    return [
        field.name
        for field in fields(GenerationRequest)
        if field.name in type(body).model_fields and field.name not in BUILT_FIELDS
    ]


def _param_of(field: str, body: SamplingFields) -> str:
    """The body's field a request field came from, for the 400 that names it."""
    if field == "grammar":
        return "response_format" if getattr(body, "response_format", None) else "tool_choice"
    if field == "prompt_tokens":
        return "messages" if hasattr(body, "messages") else "prompt"
    if field == "logprobs" and hasattr(body, "top_logprobs"):
        return "top_logprobs"
    return field


def resolve_max_tokens(body: SamplingFields, limits: ServiceLimits, room: int) -> int:
    """max_completion_tokens wins over the legacy max_tokens; absent both, the server default.

    `room` is what the planned context leaves after the prompt.
    """
    for name in ("max_tokens", "max_completion_tokens"):  # both checked, though one wins
        given = getattr(body, name)
        if given is not None and not 1 <= given <= limits.max_tokens_cap:
            raise APIError(
                400,
                f"{name} must be between 1 and {limits.max_tokens_cap}, got {given}",
                param=name,
                code="invalid_value",
            )
    param, value = "max_completion_tokens", body.max_completion_tokens
    if value is None:
        param, value = "max_tokens", body.max_tokens
    if room < 1:
        raise APIError(
            400,
            "the prompt fills the whole context the KV cache was planned for "
            "(--context-tokens); shorten it",
            param="messages" if hasattr(body, "messages") else "prompt",
            code="context_length_exceeded",
        )
    if value is None:
        return min(limits.default_max_tokens, limits.max_tokens_cap, room)
    if value > room:
        raise APIError(
            400,
            f"{param}={value} does not fit: the prompt leaves room for {room} tokens in the "
            "context the KV cache was planned for (--context-tokens); lower it or shorten "
            "the prompt",
            param=param,
            code="context_length_exceeded",
        )
    return value


def wait_budget_s(service: Service) -> float:
    return service.limits.request_timeout_s + TIMEOUT_MARGIN_S


async def watch_events(
    submission: Submission, timeout_s: float, tick_s: float
) -> AsyncIterator[TokenEvent | None]:
    """Yield the submission's events, and a None tick every `tick_s` however busy the stream.

    The ticks let the caller look at the client (gone?) or keep the connection alive.
    Raises GenerationTimeout when the final event has not come within `timeout_s`. However
    the caller stops iterating (timeout, disconnect, error), an unfinished submission is
    cancelled so the engine moves on to the next request.
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    next_tick = loop.time() + tick_s
    finished = False
    try:
        while not finished:
            now = loop.time()
            if now >= deadline:
                raise GenerationTimeout(f"no result within {timeout_s:g} s")
            if now >= next_tick:
                next_tick = now + tick_s
                yield None
                continue
            event = await submission.next_event(min(next_tick, deadline) - now)
            if event is None:
                continue
            finished = event.finish_reason is not None
            yield event
    finally:
        if not finished:
            log.info(
                "request %s abandoned before it finished; cancelling it",
                submission.request.request_id,
            )
            submission.cancel()


def failure_of(event: TokenEvent) -> APIError:
    """The API error for a final event that is not "stop" or "length"."""
    message = event.error or f"the generation ended with '{event.finish_reason}'"
    if event.failure is Failure.TIMEOUT:  # the request's own deadline
        return generation_timeout(message)
    return engine_unavailable(message)


async def collect(
    submission: Submission, timeout_s: float, is_disconnected: Callable[[], Awaitable[bool]]
) -> Outcome:
    """Gather a whole generation; cancel it when the client goes away or time runs out."""
    parts: list[str] = []
    scores: list[TokenScore] = []
    try:
        async with aclosing(watch_events(submission, timeout_s, DISCONNECT_POLL_S)) as events:
            async for event in events:
                if event is None:
                    if await is_disconnected():
                        raise APIError(CLIENT_CLOSED, "the client closed the request")
                    continue
                parts.append(event.text)
                score = TokenScore.of(event)
                if score is not None:
                    scores.append(score)
                if event.finish_reason is not None and event.finish_reason.natural:
                    text = "".join(parts)
                    return Outcome(
                        text,
                        event.finish_reason,
                        event.prompt_tokens,
                        event.completion_tokens,
                        scores,
                        event.cached_tokens,
                    )
                if event.finish_reason is not None:
                    raise failure_of(event)
    except GenerationTimeout as error:
        raise generation_timeout(f"request timed out: {error}") from None
    raise engine_unavailable("the engine ended the generation without a final event")
