"""--model as a Hugging Face repo id, resolved offline from a real huggingface_hub cache layout."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from engines.model.reference import parse_repo_id, resolve_reference
from errors import ModelError
from tests.helpers.cluster import REPO_ROOT, child_env
from tests.helpers.hf_cache import COMMIT, cache_repo

REPO_ID = "tandem-test/tiny-llama"


def tandem(args: list[str], hf_home: Path, timeout_s: float = 60) -> subprocess.CompletedProcess:
    """`tandem ARGS` offline against the cache in `hf_home` (the hub reads both at import)."""
    return subprocess.run(
        [sys.executable, "-m", "cli.main", *args],
        cwd=REPO_ROOT,
        env=child_env({"HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "1"}),
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("mlx-community/Qwen3-30B-A3B-4bit", ("mlx-community/Qwen3-30B-A3B-4bit", None)),
        ("org/name@v1.0", ("org/name", "v1.0")),
        (f"org/name@{COMMIT}", ("org/name", COMMIT)),
        ("org/name@refs/pr/3", ("org/name", "refs/pr/3")),
        ("just-a-name", None),
        ("/abs/path/model", None),
        ("a/b/c", None),
        ("org/name@", None),
    ],
)
def test_parse_repo_id(text: str, expected: tuple[str, str | None] | None) -> None:
    assert parse_repo_id(text) == expected


def test_a_local_directory_wins_and_needs_no_hub(demo_model_dir: Path) -> None:
    reference = resolve_reference(str(demo_model_dir))
    assert reference.path == demo_model_dir and reference.repo_id is None


def test_neither_a_directory_nor_a_repo_id_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ModelError, match="not a Hugging Face repo id"):
        resolve_reference(str(tmp_path / "missing"))


def test_plan_resolves_a_repo_id_through_the_cache(demo_model_dir: Path, tmp_path: Path) -> None:
    hf_home = tmp_path / "hf"
    snapshot = cache_repo(demo_model_dir, hf_home, REPO_ID)
    for model in (REPO_ID, f"{REPO_ID}@{COMMIT}"):  # refs/main, and the commit itself
        result = tandem(["plan", "--model", model, "--world-size", "2"], hf_home)
        assert result.returncode == 0, result.stderr
        assert f"model: {REPO_ID}@{COMMIT[:12]} (llama" in result.stdout
    # The snapshot is a directory of symlinks into blobs/, exactly as the hub resolves it.
    assert (snapshot / "config.json").is_symlink()


def test_offline_and_not_cached_is_one_clear_line(demo_model_dir: Path, tmp_path: Path) -> None:
    hf_home = tmp_path / "hf"
    cache_repo(demo_model_dir, hf_home, REPO_ID)
    for model, fetch in (
        ("tandem-test/absent", "hf download tandem-test/absent"),
        (f"{REPO_ID}@v2", f"hf download {REPO_ID} --revision v2"),
    ):
        result = tandem(["plan", "--model", model, "--world-size", "2"], hf_home)
        assert result.returncode != 0
        errors = [line for line in result.stderr.splitlines() if line.strip()]
        assert len(errors) == 1, result.stderr
        assert model in errors[0] and "HF_HUB_OFFLINE" in errors[0] and fetch in errors[0]


@pytest.mark.cluster
def test_serve_a_repo_id_over_pp_with_an_agent_resolving_its_own_cache(
    demo_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The agent gets repo@commit, not a path, and finds it in a different HF_HOME of its own."""
    from openai import OpenAI

    from tests.helpers.cluster import AgentPool
    from tests.helpers.reference import PROMPTS, single_outputs
    from tests.helpers.serve import start_serve

    coordinator_home, agent_home = tmp_path / "hf-coordinator", tmp_path / "hf-agent"
    cache_repo(demo_model_dir, coordinator_home, REPO_ID)
    cache_repo(demo_model_dir, agent_home, REPO_ID)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    pool = AgentPool(tmp_path / "agents")
    server = None
    try:
        monkeypatch.setenv("HF_HOME", str(agent_home))  # the children inherit it
        pool.start("agent", memory_limit="200M", real_roles=True)
        monkeypatch.setenv("HF_HOME", str(coordinator_home))
        server = start_serve(
            tmp_path, REPO_ID, pool.cluster_key, ["--parallelism", "pp", "--max-batch", "2"]
        )
        status, models = server.get("/v1/models")
        assert status == 200
        assert models["data"][0]["id"] == REPO_ID
        assert models["data"][0]["revision"] == COMMIT
        cluster = server.cluster()
        assert cluster["strategy"] == "pp", cluster["reason"]
        assert (cluster["model"]["repo_id"], cluster["model"]["revision"]) == (REPO_ID, COMMIT)
        client = OpenAI(base_url=server.base_url + "/v1", api_key="unused", timeout=60)
        texts = [
            client.completions.create(model=REPO_ID, prompt=p, max_tokens=48, temperature=0)
            .choices[0]
            .text
            for p in PROMPTS
        ]
        assert texts == single_outputs(demo_model_dir)
        # The stage worker found the model in the agent's own cache, not the coordinator's.
        assert f"resolved to {agent_home}" in pool.logs(), pool.logs()
    finally:
        if server is not None:
            server.stop()
        pool.stop_all()


@pytest.mark.cluster
def test_an_agent_without_the_model_fetches_it_from_the_coordinator(
    demo_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The agent's Hugging Face cache is empty and offline: its pp stage fetches its share of
    the coordinator's copy over the cluster channel, verified; a tp rank then fetches only its
    share (its slices of what mlx-lm's Model.shard splits, the rest whole: at most 60% of the
    model). Both serve what the single engine says."""
    from openai import OpenAI

    from engines.weights.fetch import cached_model
    from tests.helpers.cluster import AgentPool
    from tests.helpers.reference import PROMPTS, single_outputs
    from tests.helpers.serve import start_serve

    coordinator_home, agent_home = tmp_path / "hf-coordinator", tmp_path / "hf-empty"
    cache_repo(demo_model_dir, coordinator_home, REPO_ID)
    agent_cache = tmp_path / "agent-cache"
    expected = single_outputs(demo_model_dir)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    pool = AgentPool(tmp_path / "agents")
    servers = []
    try:
        monkeypatch.setenv("HF_HOME", str(agent_home))
        agent = pool.start(
            "empty",
            memory_limit="200M",
            real_roles=True,
            extra_args=["--cache-dir", str(agent_cache)],
        )
        monkeypatch.setenv("HF_HOME", str(coordinator_home))
        args = ["--parallelism", "pp", "--max-batch", "2"]
        server = start_serve(tmp_path, REPO_ID, pool.cluster_key, args, name="first")
        servers.append(server)
        cluster = server.cluster()
        weights = cluster["weights"]
        # The agent's stage is the last: its layers, the norm and the head, nothing else.
        stage = cluster["plan"]["stages"][1]
        assert stage["layers"][1] == 4
        [(share, what)] = [(h, w) for h, w in weights["offers"].items() if w != "whole model"]
        assert what.startswith(f"layers {stage['layers'][0]}-3 + head")
        assert 0 < sum(weights["sent_bytes"].values()) < weights["total_bytes"]
        copy = cached_model(agent_cache / "models", share)
        assert copy is not None
        # The plan checked the agent's disk; its progress reached /v1/cluster.
        disk = next(c for c in cluster["plan"]["checks"] if c["name"] == "pp disk")
        assert disk["passed"] and f"{agent.node_id} receives layers" in disk["detail"]
        [member] = [m for m in cluster["members"] if m["node_id"] == agent.node_id]
        assert member["disk_free_bytes"] > 0
        assert member["transfer"]["done_bytes"] == member["transfer"]["total_bytes"] > 0
        client = OpenAI(base_url=server.base_url + "/v1", api_key="unused", timeout=60)
        texts = [
            client.completions.create(model=REPO_ID, prompt=p, max_tokens=48, temperature=0)
            .choices[0]
            .text
            for p in PROMPTS
        ]
        assert texts == expected
        assert "fetching it" in pool.logs() and "fetched into" in pool.logs()
        server.stop()
        tp_args = ["--parallelism", "tp", "--collective", "ring", "--max-batch", "2"]
        server = start_serve(tmp_path, REPO_ID, pool.cluster_key, tp_args, name="tp")
        servers.append(server)
        cluster = server.cluster()
        assert cluster["strategy"] == "tp", cluster["reason"]
        weights = cluster["weights"]
        [(share, what)] = [(h, w) for h, w in weights["offers"].items() if w.startswith("tp")]
        assert what.startswith("tp rank 1 of 2 of ")
        assert 0 < sum(weights["sent_bytes"].values()) <= 0.6 * weights["total_bytes"]
        assert cached_model(agent_cache / "models", share) is not None
        disk = next(c for c in cluster["plan"]["checks"] if c["name"] == "tp disk")
        assert disk["passed"], disk
        assert f"{agent.node_id} receives its tp share (rank 1 of 2)" in disk["detail"]
        client = OpenAI(base_url=server.base_url + "/v1", api_key="unused", timeout=60)
        texts = [
            client.completions.create(model=REPO_ID, prompt=p, max_tokens=48, temperature=0)
            .choices[0]
            .text
            for p in PROMPTS
        ]
        assert texts == expected
    finally:
        for server in servers:
            server.stop()
        pool.stop_all()
