"""transformers' index of its own modules, kept on disk so each process does not rebuild it.

transformers (5.x) builds its lazy-import table by reading the source of every model it ships
(~1,700 files) in `define_import_structure`, on every start of every process that imports it:
~0.75 s of the ~1.6 s that `import mlx_lm` costs, paid again by serve, its engine core and each
worker, rank, stage and probe. The table depends only on the installed transformers, so it is
kept as JSON under the cache directory, stamped with the package's location and modification
time: an upgrade rebuilds it. Anything unexpected (no cache directory, a corrupt or stale file,
a transformers without that function) falls back to transformers' own scan.

`install()` must run before transformers is first imported: the function is replaced while
transformers' own `__init__` is importing it, so every caller sees the cached one.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

TARGET = "transformers.utils.import_utils"
FILE_NAME = "transformers-import-structure.json"

Structure = dict[frozenset[str], dict[str, set[str]]]


def cache_file() -> Path:
    from discovery.directories import default_cache_dir

    return default_cache_dir() / FILE_NAME


def _stamp(module_file: str) -> str:
    """The installed transformers this index describes: its directory and when it changed."""
    package = Path(module_file).resolve().parents[1]  # .../transformers/utils/import_utils.py
    return f"{package}:{(package / '__init__.py').stat().st_mtime_ns}"


def _encode(structure: Structure) -> list[Any]:
    return [
        [sorted(backends), {m: sorted(names) for m, names in modules.items()}]
        for backends, modules in structure.items()
    ]


def _decode(rows: list[Any]) -> Structure:
    return {
        frozenset(backends): {m: set(names) for m, names in modules.items()}
        for backends, modules in rows
    }


class IndexOnDisk:
    """The cached answers of `define_import_structure`, one JSON file for every call."""

    def __init__(self, path: Path, stamp: str) -> None:
        self.path, self.stamp = path, stamp
        self.entries: dict[str, list[Any]] = {}
        try:
            saved = json.loads(path.read_text())
            if saved.get("stamp") == stamp:
                self.entries = saved["entries"]
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            pass  # no index yet, or one from another transformers: rebuild

    def wrap(self, scan: Callable[..., Structure]) -> Callable[..., Structure]:
        @functools.lru_cache
        def define_import_structure(module_path: str, prefix: str | None = None) -> Structure:
            key = json.dumps([str(module_path), prefix])
            if key in self.entries:
                try:
                    return _decode(self.entries[key])
                except (ValueError, TypeError, AttributeError):
                    pass  # a damaged entry: scan again
            structure = scan(module_path, prefix)
            self.entries[key] = _encode(structure)
            self._save()
            return structure

        return define_import_structure

    def _save(self) -> None:
        """Atomically, so concurrent processes never read half a file; best effort."""
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            partial = self.path.with_name(f".{self.path.name}.{os.getpid()}")
            partial.write_text(json.dumps({"stamp": self.stamp, "entries": self.entries}))
            os.replace(partial, self.path)
        except OSError:
            pass


class _PatchingLoader(importlib.abc.Loader):
    def __init__(self, inner: importlib.abc.Loader, path: Path) -> None:
        self.inner, self.path = inner, path

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self.inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self.inner.exec_module(module)
        scan = getattr(module, "define_import_structure", None)
        if callable(scan) and getattr(module, "__file__", None):
            index = IndexOnDisk(self.path, _stamp(module.__file__))
            # transformers keeps its own per-process lru_cache on the function; ours replaces it
            module.define_import_structure = index.wrap(getattr(scan, "__wrapped__", scan))


class _Finder(importlib.abc.MetaPathFinder):
    def __init__(self, path: Path) -> None:
        self.path = path

    def find_spec(
        self, name: str, path: Any, target: Any = None
    ) -> importlib.machinery.ModuleSpec | None:
        if name != TARGET:
            return None
        sys.meta_path.remove(self)  # once is enough
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _PatchingLoader(spec.loader, self.path)
        return spec


def install(path: Path | None = None) -> None:
    """Serve transformers' import table from disk in this process (no-op once transformers
    is already imported)."""
    if TARGET in sys.modules or any(isinstance(f, _Finder) for f in sys.meta_path):
        return
    sys.meta_path.insert(0, _Finder(path or cache_file()))
