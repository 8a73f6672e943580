"""transformers' import table served from disk: the same table as its own scan, rebuilt when
stale or damaged, and each process importing mlx-lm faster for it."""

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
        env={"PATH": "/usr/bin:/bin", "HOME": str(cache_home), "XDG_CACHE_HOME": str(cache_home)},
    )
    assert done.returncode == 0, done.stderr
    return done.stdout, time.monotonic() - started


def table(cache_home: Path, cached: bool) -> str:
    install = "from engines.core import import_index; import_index.install()" if cached else ""
    return run_python(PRINT_TABLE.format(install=install), cache_home)[0]


def test_the_cached_table_is_transformers_own_and_survives_a_damaged_file(tmp_path: Path) -> None:
    own = table(tmp_path, cached=False)
    assert not (tmp_path / "tandem" / FILE_NAME).exists()
    built = table(tmp_path, cached=True)  # scans, then writes the file
    index = tmp_path / "tandem" / FILE_NAME
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


def test_importing_mlx_lm_through_engines_is_faster_with_the_index(tmp_path: Path) -> None:
    with_index = "import engines, mlx_lm.utils"
    without = "import mlx_lm.utils"
    run_python(with_index, tmp_path)  # builds the index
    timings = {"with": [], "without": []}
    for _ in range(3):  # interleaved: this machine is noisy
        timings["with"].append(run_python(with_index, tmp_path)[1])
        timings["without"].append(run_python(without, tmp_path)[1])
    fastest_with, fastest_without = min(timings["with"]), min(timings["without"])
    # ~0.9 s against ~1.6 s here; a margin for the machine's noise
    assert fastest_with < 0.85 * fastest_without, timings
