"""`--model` text -> a local model directory: a path, or a Hugging Face repo id via its cache."""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from pathlib import Path

from errors import ModelError

log = logging.getLogger(__name__)

# ORG/NAME[@REVISION], as the Hub spells repo ids (letters, digits, '-', '_', '.').
REPO_ID_PATTERN = re.compile(
    r"^(?P<repo>[A-Za-z0-9][\w.-]{0,95}/[A-Za-z0-9][\w.-]{0,95})(?:@(?P<revision>[\w./-]+))?$"
)
COMMIT_PATTERN = re.compile(r"^[0-9a-f]{40}$")
# The files mlx-lm needs from a repo (what mlx_lm.utils fetches): config, weights, tokenizer.
DOWNLOAD_PATTERNS = (
    "*.json",
    "model*.safetensors",
    "*.py",
    "tokenizer.model",
    "*.tiktoken",
    "tiktoken.model",
    "*.txt",
    "*.jsonl",
    "*.jinja",
)


@dataclass(frozen=True, slots=True)
class ModelReference:
    """Where a model's files are here, and (for a repo id) which repo and commit they are."""

    path: Path
    repo_id: str | None = None
    revision: str | None = None  # the revision asked for (branch, tag or commit); None: main
    commit: str | None = None  # the commit the cache resolved it to


def parse_repo_id(text: str) -> tuple[str, str | None] | None:
    """(repo id, revision) when `text` is spelled ORG/NAME[@REVISION], else None."""
    match = REPO_ID_PATTERN.match(text.strip())
    if match is None:
        return None
    return match.group("repo"), match.group("revision")


def resolve_reference(text: str | Path) -> ModelReference:
    """A local directory as it is; anything else spelled ORG/NAME[@REV] through huggingface_hub.

    The hub honours HF_HOME / HF_HUB_CACHE and HF_HUB_OFFLINE; files already cached are not
    fetched again, and a download shows its progress bars on stderr.
    """
    local = Path(text).expanduser()
    if local.is_dir():
        return ModelReference(path=local)
    parsed = parse_repo_id(str(text))
    if parsed is None:
        raise ModelError(
            f"--model {text}: no such directory, and not a Hugging Face repo id (ORG/NAME[@REV])"
        )
    repo_id, revision = parsed
    path = _snapshot(repo_id, revision)
    commit = path.name if COMMIT_PATTERN.match(path.name) else None
    return ModelReference(path=path, repo_id=repo_id, revision=revision, commit=commit)


def local_model_path(text: str | Path) -> Path:
    """The local directory for `text` (what workers call on the path or repo@commit they get)."""
    return resolve_reference(text).path


def _snapshot(repo_id: str, revision: str | None) -> Path:
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    named = f"{repo_id}@{revision}" if revision else repo_id
    fetch = f"hf download {repo_id}" + (f" --revision {revision}" if revision else "")
    try:
        folder = snapshot_download(
            repo_id, revision=revision, allow_patterns=list(DOWNLOAD_PATTERNS)
        )
    except LocalEntryNotFoundError as error:
        where = f"the Hugging Face cache ({constants.HF_HUB_CACHE})"
        if constants.HF_HUB_OFFLINE:
            raise ModelError(
                f"model {named} is not in {where} and HF_HUB_OFFLINE is set: fetch it with "
                f"`{fetch}` (network needed), or pass a local directory"
            ) from None
        raise ModelError(
            f"model {named} is not in {where} and the Hub cannot be reached: fetch it with "
            f"`{fetch}` when online, or pass a local directory"
        ) from error
    except RevisionNotFoundError:
        raise ModelError(f"model {repo_id} has no revision {revision!r} on the Hub") from None
    except RepositoryNotFoundError:
        raise ModelError(
            f"model {repo_id} is not on the Hub (or is private: log in with `hf auth login`)"
        ) from None
    except HfHubHTTPError as error:
        raise ModelError(f"model {named}: the Hub refused the download: {error}") from None
    except OSError as error:
        raise ModelError(f"model {named}: cannot store it in the cache: {error}") from error
    log.info("model %s resolved to %s", named, folder)
    return Path(folder)
