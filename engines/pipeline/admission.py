"""What the pipeline's wire carries for a request: the request as its last stage samples it,
checked before the request queues (Engine.refusal) so that the API answers a 400 instead of a
failed insert."""

from __future__ import annotations

from dataclasses import replace

from engines.core.request import GenerationRequest
from engines.decoding.sampling import request_seed
from engines.pipeline import wire
from engines.pipeline.sequence_documents import MAX_UID, PENALTY_CONTEXT, PREFIX_ENTRY
from engines.pipeline.wire import Kind
from errors import RequestError


def sampling_of(request: GenerationRequest) -> GenerationRequest:
    """The request a BEGIN carries to the last stage: its seed set, and of its prompt only the
    tail the penalties look at."""
    tail = request.prompt_tokens[-PENALTY_CONTEXT:]
    return replace(request, prompt_tokens=tail, seed=request_seed(request))


def wire_refusal(request: GenerationRequest, sampling: GenerationRequest) -> str | None:
    """Why the wire cannot carry `request`: a request out of its limits, or a BEGIN document
    (a grammar, mostly) too large for a frame; None when it can."""
    try:
        sampling.check()
    except RequestError as error:
        return f"request {request.request_id}: {error}"
    begin = {**sampling.document(), PREFIX_ENTRY: MAX_UID}  # its largest BEGIN
    try:
        wire.document_frame(Kind.BEGIN, 0, begin)
    except wire.WireError as error:
        if request.grammar is None:
            return f"request {request.request_id} does not fit in a pipeline BEGIN frame ({error})"
        return (
            f"the output grammar of {len(request.grammar)} characters does not fit in "
            f"a pipeline BEGIN frame ({error}); use a smaller schema"
        )
    return None


def request_refusal(request: GenerationRequest) -> str | None:
    """The pipeline engine's `refusal`: a pure function of the request, so an API process
    without the engine asks it too (engines/core/core_process.py)."""
    return wire_refusal(request, sampling_of(request))
