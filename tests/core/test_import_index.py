"""transformers' import table served from disk: the same table as its own scan, rebuilt when
stale or damaged, and in force in every process that imports engines."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from engines.core.import_index import FILE_NAME

ROOT = Path(__file__).resolve().parents[2]

# Prints the table transformers builds for its models package, as sorted JSON, and what
# AutoTokenizer resolves to (the lookup mlx-lm's tokenizer loading does).
PRINT_TABLE = """
import json, sys
{install}
import transformers.models as models_package
from transformers import AutoTokenizer
from transformers.utils import import_utils
table = import_utils.define_import_structure(models_package.__file__)
rows = [[sorted(k), sorted((m, sorted(n)) for m, n in v.items())] for k, v in table.items()]
print(json.dumps(sorted(rows)))
print(AutoTokenizer.__module__)
"""


def run_python(code: str, cache_home: Path) -> tuple[str, float]:
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={"PATH": "/usr/bin:/bin", "HOME": str(cache_home)},
    )
    assert done.returncode == 0, done.stderr
    return done.stdout, time.monotonic() - started


def table(cache_home: Path, cached: bool) -> str:
    install = "from engines.core import import_index; import_index.install()" if cached else ""
    return run_python(PRINT_TABLE.format(install=install), cache_home)[0]


def test_the_cached_table_is_transformers_own_and_survives_a_damaged_file(tmp_path: Path) -> None:
    own = table(tmp_path, cached=False)
    assert not (tmp_path / ".cache" / "tandem" / FILE_NAME).exists()
    built = table(tmp_path, cached=True)  # scans, then writes the file
    index = tmp_path / ".cache" / "tandem" / FILE_NAME
    assert index.exists()
    read = table(tmp_path, cached=True)  # reads the file
    assert own == built == read
    assert "AutoTokenizer" not in own.splitlines()[-1]  # a real module path, not a stub

    saved = json.loads(index.read_text())
    index.write_text(json.dumps({"stamp": "another transformers", "entries": saved["entries"]}))
    assert table(tmp_path, cached=True) == own
    assert json.loads(index.read_text())["stamp"] == saved["stamp"]  # rebuilt for this one

    index.write_text("{ half a file")
    assert table(tmp_path, cached=True) == own


def test_a_process_that_imports_engines_reads_the_index(tmp_path: Path) -> None:
    """The index is in force wherever tandem runs (its speed: tests/bench/bench_startup.py)."""
    code = (
        "import engines, mlx_lm.utils\n"
        "from transformers.utils import import_utils\n"
        "print(import_utils.define_import_structure.__qualname__)"
    )
    assert (
        run_python(code, tmp_path)[0].strip() == "IndexOnDisk.wrap.<locals>.define_import_structure"
    )
    assert (tmp_path / ".cache" / "tandem" / FILE_NAME).exists()
