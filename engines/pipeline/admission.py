"""What the pipeline's wire can carry for a request: its sampling document, checked before
the request queues (Engine.refusal) so that the API answers a 400 instead of a failed insert."""

from __future__ import annotations

from engines.core.engine import GenerationRequest
from engines.decoding.sampling import request_seed
from engines.pipeline import wire
from engines.pipeline.sequence_documents import MAX_UID, PENALTY_CONTEXT, Sampling
from engines.pipeline.wire import Kind


def sampling_of(request: GenerationRequest) -> Sampling:
    """What the last stage needs to sample this request's tokens."""
    return Sampling(
        request.temperature,
        request.top_p,
        request_seed(request),
        request.request_id,
        request.repetition_penalty,
        request.presence_penalty,
        request.frequency_penalty,
        request.prompt_tokens[-PENALTY_CONTEXT:],
        request.logprobs,
        request.grammar,
    )


def wire_refusal(request: GenerationRequest, sampling: Sampling) -> str | None:
    """Why the wire cannot carry `request`: a grammar too large for a BEGIN frame, or
    sampling values the last stage would refuse (Sampling.of); None when it can."""
    if request.grammar is not None:
        begin = {**sampling.document(), "prefix_entry": MAX_UID}  # its largest BEGIN
        try:
            wire.document_frame(Kind.BEGIN, 0, begin)
        except wire.WireError as error:
            return (
                f"the output grammar of {len(request.grammar)} characters does not fit in "
                f"a pipeline BEGIN frame ({error}); use a smaller schema"
            )
    try:
        Sampling.of(sampling.document())
    except wire.WireError as error:
        return f"request {request.request_id}: {error}"
    return None
