"""What a stage holds for one chain session: the sealed hops to its neighbours, the caches of
the sequences it runs, its disk tier reopened for the session, and on the last stage each
sequence's sampler and scoring (penalties with the tokens they look at, grammar, logprobs, or
why the sequence was refused). A session ends with its coordinator's connection, and all of
this with it but the disk tier's files.
"""

from __future__ import annotations

import socket
import time
from typing import Any

import mlx.core as mx

from engines.core.request import GenerationRequest
from engines.decoding.grammar import LogitsProcessor
from engines.decoding.sampling import Sampler, make_request_processors
from engines.pipeline.batches import StageBatches
from engines.pipeline.chain_disk import SessionDisk
from engines.pipeline.frame_clock import StageMeter
from engines.pipeline.stage_model import StageModel
from engines.prefix_cache.disk_tier import DiskTier


class _Session:
    """One chain session: the sealed hops, and the sequences this stage holds for it."""

    def __init__(
        self,
        inbound: Any,
        inbound_sock: socket.socket,
        outbound: Any,
        outbound_sock: socket.socket,
        stage: StageModel,
        disk: DiskTier | None = None,
    ) -> None:
        self.inbound = inbound
        self.inbound_sock = inbound_sock
        self.outbound = outbound
        self.outbound_sock = outbound_sock
        self.previous: range | None = None  # the previous stage's layers, known after SETUP
        self.next_number = 0  # 0 = SETUP; every later frame down the chain counts from 1
        self.batches = StageBatches(stage, disk)
        self.disk: SessionDisk | None = None  # reopened at SETUP, once the previous one closed
        self.samplers: dict[int, Sampler] = {}  # last stage: uid -> its own sampler
        self.meter = StageMeter(inbound, outbound)  # compute and sealing, sent with each frame
        self.scoring: dict[int, _Scoring] = {}  # last stage: penalties / logprobs / grammar
        self.last_frame_at = time.monotonic()
        self.closed = False

    def sockets(self) -> list[socket.socket]:
        return [] if self.closed else [self.inbound_sock, self.outbound_sock]

    def close(self) -> None:
        """Close both hops and forget this session's prefix-cache entries; their files stay
        (written first) for the next session to adopt."""
        self.closed = True
        self.inbound.close()
        self.outbound.close()
        self.batches.prefix.close()


class _Scoring:
    """A sequence's logits processors (decoding/sampling.py's chain, as every engine's) with
    the tokens they look at, its logprobs count, or why it was refused (its grammar did not
    compile here)."""

    def __init__(
        self,
        request: GenerationRequest,
        grammar: LogitsProcessor | None = None,
        refusal: str | None = None,
    ) -> None:
        self.processors = make_request_processors(request, grammar)
        # what mlx-lm's BatchGenerator passes them: the prompt (its tail here), then every
        # sampled token; the grammar takes its first call's length as the prompt's
        self.tokens = list(request.prompt_tokens)
        self.logprobs = request.logprobs
        self.refusal = refusal

    @property
    def processes(self) -> bool:
        return bool(self.processors)

    def process(self, logits: mx.array) -> mx.array:
        """One row's raw logits (1, V) through the request's processors, in their order."""
        tokens = mx.array(self.tokens, dtype=mx.int32)
        for processor in self.processors:
            logits = processor(tokens, logits)
        return logits

    def sampled(self, token: int) -> None:
        if self.processors:
            self.tokens.append(token)


def scores(request: GenerationRequest) -> bool:
    """Whether the last stage does more than sample `request`: logits processors (its grammar
    among them) or logprobs."""
    return (
        request.grammar is not None
        or request.logprobs is not None
        or bool(make_request_processors(request))
    )
