"""Losing a rank while a batch of 8 decodes (each test owns its cluster): killed, frozen,
aborted, or its agent gone while idle."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from engines.core.request import GenerationRequest
from errors import EngineError
from tests.helpers.engine import start_batch, step_until_error
from tests.helpers.tensor_parallel import PROMPTS, close_cluster, open_cluster

pytestmark = pytest.mark.cluster

# -- losing a rank while a batch of 8 decodes (each test owns its cluster) --------------------


def test_killing_rank_1_mid_batch_raises_quickly(demo_model_dir):
    cluster = open_cluster(demo_model_dir, rank_nodes=("here", "node-b"))
    try:
        prompt = tuple(cluster.engine.tokenizer.encode(PROMPTS[0]))
        start_batch(cluster.engine, prompt, size=8, steps=4)
        cluster.ranks[0].kill()
        error, seconds = step_until_error(cluster.engine)
        assert seconds < 10
        assert "tensor-parallel rank 1 on node node-b (127.0.0.1:" in str(error)  # the culprit
        assert not cluster.engine.healthy()
        deadline = time.monotonic() + 5  # the supervisor is told from the reader thread
        while not cluster.lost and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(cluster.lost) == 1 and "connection" in cluster.lost[0]
    finally:
        close_cluster(cluster)


def test_abort_unblocks_a_batch_stuck_on_a_frozen_rank(demo_model_dir):
    cluster = open_cluster(demo_model_dir, token_timeout_s=30, first_token_timeout_s=30)
    frozen = cluster.ranks[0]
    try:
        prompt = tuple(cluster.engine.tokenizer.encode(PROMPTS[0]))
        start_batch(cluster.engine, prompt, size=8, steps=2)
        os.kill(frozen.pid, signal.SIGSTOP)  # its sockets stay open: all_sum blocks, no error
        threading.Timer(1.0, cluster.engine.abort, ["agent lost"]).start()
        error, seconds = step_until_error(cluster.engine)
        assert seconds < 5  # long before the 30 s token timeout
        assert str(error) == "agent lost"  # the supervisor's reason names the culprit
        assert not cluster.engine.healthy()
        assert cluster.lost == []  # the supervisor called abort: no callback back to it
    finally:
        os.kill(frozen.pid, signal.SIGKILL)
        close_cluster(cluster)


def test_token_timeout_catches_a_frozen_rank(demo_model_dir):
    cluster = open_cluster(
        demo_model_dir, token_timeout_s=1.5, first_token_timeout_s=3, rank_nodes=("here", "b")
    )
    frozen = cluster.ranks[0]
    try:
        prompt = tuple(cluster.engine.tokenizer.encode(PROMPTS[0]))
        start_batch(cluster.engine, prompt, size=8, steps=2)
        os.kill(frozen.pid, signal.SIGSTOP)
        error, seconds = step_until_error(cluster.engine)
        assert seconds < 3.5
        assert "rank 1 on node b (127.0.0.1:" in str(error)  # the frozen one, not rank 0
        assert "did not answer rank 0 within 1.5 s" in str(error)
        assert not cluster.engine.healthy() and cluster.lost
    finally:
        os.kill(frozen.pid, signal.SIGKILL)
        close_cluster(cluster)


def test_an_idle_group_notices_a_rank_whose_agent_went_away(demo_model_dir):
    cluster = open_cluster(demo_model_dir)
    try:
        stdin = cluster.ranks[0].stdin
        assert stdin is not None
        stdin.close()  # what an agent that exits looks like to its worker
        assert cluster.ranks[0].wait(10) == 0
        deadline = time.monotonic() + 5
        while not cluster.lost and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(cluster.lost) == 1  # noticed by the idle heartbeat, no request needed
        assert "connection" in cluster.lost[0]  # mlx: "closed by the peer" or "was lost"
        assert not cluster.engine.healthy()
        prompt = tuple(cluster.engine.tokenizer.encode(PROMPTS[0]))
        cluster.engine.insert(0, GenerationRequest("late", prompt, 4))
        with pytest.raises(EngineError, match=r"tensor-parallel rank 1 \(127\.0\.0\.1:"):
            cluster.engine.step()
    finally:
        close_cluster(cluster)
