"""One generation seen from the API: checked parameters, the GenerationRequest, a bounded wait."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

from engines.api.errors import APIError, engine_unavailable, generation_timeout, model_not_found
from engines.api.token_score import TokenScore
from engines.core.engine import Failure, TokenEvent
from engines.core.request import GenerationRequest
from engines.core.runner import Submission
from engines.core.service import Service, ServiceLimits
from engines.core.service_registry import ServiceRegistry
from errors import EngineError, RequestError

log = logging.getLogger(__name__)

# The runner enforces request_timeout_s itself once a request runs; the API waits a little
# longer so the runner's own message wins, and a hung engine still cannot hold a client forever.
TIMEOUT_MARGIN_S = 1.0
DISCONNECT_POLL_S = 0.25
DEFAULT_TEMPERATURE = 1.0  # OpenAI's and Anthropic's default when the field is omitted
CLIENT_CLOSED = 499  # nginx's status for "the client went away"
# Where a model answers once loaded: with --load-on-demand a request naming it waits.
WAITS_FOR_LOAD = ("unloaded", "unloading", "starting")
PENALTIES = ("presence_penalty", "frequency_penalty", "repetition_penalty")


class GenerationTimeout(Exception):
    """No final event arrived within the request's time budget."""


@dataclass(frozen=True, slots=True)
class Sampling:
    """What a request asks of its generation, in GenerationRequest's terms, whatever the
    dialect: each dialect maps its body onto this (None: the request's default).

    `names` maps a request field to the body's own name for it ("max_tokens" ->
    "max_output_tokens"), so a 400 names what the caller sent.
    """

    max_tokens: int | None = None  # None: the server's default, within the room left
    # A max_tokens beyond the room the prompt leaves: a 400, or (True) cut to the room.
    clamp_max_tokens: bool = False
    temperature: float | None = None  # None: unset (tandem serve --temperature, else below)
    default_temperature: float = DEFAULT_TEMPERATURE  # the dialect's own (Ollama's is 0.8)
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    stop: tuple[str, ...] = ()
    seed: int | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logprobs: int | None = None  # None: off; k: the token's logprob and k alternatives
    names: Mapping[str, str] = field(default_factory=dict)

    def name_of(self, request_field: str) -> str:
        return self.names.get(request_field, request_field)

    def given(self, server_temperature: float | None = None) -> dict[str, Any]:
        """The fields set, as GenerationRequest takes them (absent ones keep its defaults);
        an unset temperature is the server's (`--temperature`), else the dialect's default."""
        values = {
            "temperature": next(
                value
                for value in (self.temperature, server_temperature, self.default_temperature)
                if value is not None
            ),
            "top_p": self.top_p,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "stop": self.stop,
            "seed": self.seed,
            "repetition_penalty": self.repetition_penalty,
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            "logprobs": self.logprobs,
        }
        return {name: value for name, value in values.items() if value is not None}


@dataclass(frozen=True, slots=True)
class Outcome:
    """A finished non-streaming generation."""

    text: str
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    scores: list[TokenScore]  # one per token, when the request asked for logprobs
    cached_tokens: int = 0
    stop_sequence: str | None = None  # the stop string that ended it (None: EOS or length)
    drafted_tokens: int = 0  # speculative decoding's drafts, and those accepted
    accepted_tokens: int = 0


async def serving(models: ServiceRegistry, requested: str, param: str = "model") -> Service:
    """The served model `requested` names (its id or an alias); 404 naming what is served
    otherwise; 503 while it has no tokenizer (none until its first engine has loaded)."""
    service = models.find(requested)
    if service is None:
        raise model_not_found(requested, models.describe_ids(), param)
    return await ready_service(models, service)


async def ready_service(models: ServiceRegistry, service: Service) -> Service:
    """`service` for a request: claimed when a runner serves (so --keep-alive keeps it); with
    --load-on-demand a model that is unloaded (or being unloaded) is loaded first and the
    request waits for it (bounded); 503 while it has no tokenizer (none until its first engine
    has loaded). Without a runner otherwise (a re-plan) the request is still read and checked;
    its submit answers 503."""
    if service.claim():
        return service
    if models.on_demand is not None and service.state in WAITS_FOR_LOAD:
        try:
            return await models.on_demand.wait_loaded(service.model_id)
        except EngineError as error:
            raise engine_unavailable(str(error)) from None
    if service.tokenizer is None:
        reason = f": {service.state_reason}" if service.state_reason else ""
        raise engine_unavailable(f"the model is not loaded yet ({service.state}{reason})")
    return service


def engine_features(service: Service) -> frozenset[str]:
    """What the running engine honours beyond plain sampling (Engine.features)."""
    runner = service.runner
    return runner.engine.features if runner is not None else frozenset()


def check_features(
    features: frozenset[str], sampling: Sampling, constrained: str | None = None
) -> None:
    """400 naming the first thing asked for that the engine cannot honour (`features`, see
    engine_features); `constrained` is the body's field that asks for an output grammar."""
    for name in PENALTIES:
        if getattr(sampling, name) and "penalties" not in features:
            raise engine_lacks(sampling.name_of(name))
    if sampling.logprobs is not None and "logprobs" not in features:
        raise engine_lacks(sampling.name_of("logprobs"))
    if constrained is not None and "grammar" not in features:
        raise engine_lacks(constrained)


def engine_lacks(param: str) -> APIError:
    message = f"{param} is not supported by the engine serving this model right now"
    return APIError(400, message, param=param, code="unsupported_parameter")


def build_request(
    service: Service,
    request_id: str,
    sampling: Sampling,
    prompt_tokens: tuple[int, ...],
    context_tokens: int,
    grammar: str | None = None,
    grammar_param: str | None = None,
) -> GenerationRequest:
    """The engine-agnostic request, checked; prompt + max_tokens must fit the context the KV
    cache was planned for (an absent max_tokens shrinks to what is left); a request the running
    engine would refuse on its own (Engine.refusal) is a 400 here, before it queues."""
    room = context_tokens - len(prompt_tokens)
    request = GenerationRequest(
        request_id=request_id,
        prompt_tokens=prompt_tokens,
        max_tokens=resolve_max_tokens(sampling, service.limits, room),
        timeout_s=service.limits.request_timeout_s,
        grammar=grammar,
        **sampling.given(service.limits.temperature),
    )
    try:
        request.check()
    except RequestError as error:
        param = grammar_param if error.field == "grammar" else sampling.name_of(error.field)
        raise APIError(400, str(error), param=param, code="invalid_value") from None
    runner = service.runner
    refusal = runner.engine.refusal(request) if runner is not None else None
    if refusal is not None:
        param = grammar_param if grammar is not None else None
        raise APIError(400, refusal, param=param, code="invalid_value")
    return request


def check_max_tokens(value: int | None, param: str, limits: ServiceLimits) -> None:
    if value is not None and not 1 <= value <= limits.max_tokens_cap:
        raise APIError(
            400,
            f"{param} must be between 1 and {limits.max_tokens_cap}, got {value}",
            param=param,
            code="invalid_value",
        )


def resolve_max_tokens(sampling: Sampling, limits: ServiceLimits, room: int) -> int:
    """The request's max_tokens: the one asked for, or the server default; `room` is what the
    planned context leaves after the prompt."""
    param = sampling.name_of("max_tokens")
    value = sampling.max_tokens
    check_max_tokens(value, param, limits)
    if room < 1:
        raise APIError(
            400,
            "the prompt fills the whole context the KV cache was planned for "
            "(--context-tokens); shorten it",
            param=sampling.name_of("prompt_tokens"),
            code="context_length_exceeded",
        )
    if value is None:
        return min(limits.default_max_tokens, limits.max_tokens_cap, room)
    if value > room and sampling.clamp_max_tokens:
        return room
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
                        event.stop_sequence,
                        event.drafted_tokens,
                        event.accepted_tokens,
                    )
                if event.finish_reason is not None:
                    raise failure_of(event)
    except GenerationTimeout as error:
        raise generation_timeout(f"request timed out: {error}") from None
    raise engine_unavailable("the engine ended the generation without a final event")
