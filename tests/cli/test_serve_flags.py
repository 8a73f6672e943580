"""`tandem serve`'s flags that bound a request take their limits from the request's own."""

from __future__ import annotations

from pathlib import Path

import pytest

from cli.main import build_parser
from cli.serve import config_from_args
from cli.serve_config import ServeConfig
from engines.core.request import MAX_TOKENS
from errors import ConfigError

KEY = ["--cluster-key", "tandem-" + "A" * 43]


def serve_config(*flags: str) -> ServeConfig:
    return config_from_args(build_parser().parse_args(["serve", *KEY, *flags]))


def test_max_tokens_cap_stays_within_what_a_request_may_ask() -> None:
    assert serve_config("--max-tokens-cap", str(MAX_TOKENS)).max_tokens_cap == MAX_TOKENS
    for bad in (0, MAX_TOKENS + 1):
        with pytest.raises(ConfigError, match=f"between 1 and {MAX_TOKENS}, got {bad}"):
            serve_config("--max-tokens-cap", str(bad))


def test_the_temperature_default_is_a_request_s_temperature() -> None:
    assert serve_config().temperature is None  # each API's own default
    assert serve_config("--temperature", "0").temperature == 0.0
    for bad in ("-0.5", "2.5"):
        with pytest.raises(
            ConfigError, match=f"--temperature must be between 0 and 2.0, got {bad}"
        ):
            serve_config("--temperature", bad)


def test_model_aliases_are_names_or_patterns_of_the_served_model(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    flags = ("--model-alias", "claude-*", "--model-alias", "gpt-4o=tandem-demo")
    assert serve_config(*flags).model_aliases == (("claude-*", None), ("gpt-4o", "tandem-demo"))
    for bad in ("=x", "name="):
        with pytest.raises(ConfigError, match="NAME or NAME=ID"):
            serve_config("--model-alias", bad)
    monkeypatch.setenv("TANDEM_MODEL_ALIAS", "a, b=m")
    assert serve_config().model_aliases == (("a", None), ("b", "m"))


def test_a_served_id_answers_to_its_aliases() -> None:
    from engines.core.service import Service

    service = Service("tandem-demo", None, model_aliases=(("claude-*", "tandem-demo"),))
    assert service.served_id("tandem-demo") == "tandem-demo"
    assert service.served_id("claude-sonnet-4-5") == "tandem-demo"
    assert service.served_id("gpt-4o") is None


def test_the_gemm_layout_flag_reaches_every_process_through_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """--gemm-layout is handed on as TANDEM_GEMM_LAYOUT, which engines/model/gemm_layout.py
    reads in the engine core and in every stage worker started from here."""
    import os

    from cli.options import apply_blas_flags

    for flags, expected in (((), "auto"), (("--gemm-layout", "off"), "off")):
        monkeypatch.delenv("TANDEM_GEMM_LAYOUT", raising=False)
        monkeypatch.setenv("TANDEM_BLAS", "auto")  # restored afterwards, like the layout's
        apply_blas_flags(build_parser().parse_args(["serve", *KEY, *flags]))
        assert os.environ["TANDEM_GEMM_LAYOUT"] == expected
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", *KEY, "--gemm-layout", "fastest"])


def test_the_cpu_kernels_flag_reaches_the_kernels_switch_through_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """--cpu-kernels is handed on as TANDEM_CPU_KERNELS, which engines/kernels reads (through
    engines/core/blas.py) in every process that loads a quantized model."""
    from cli.options import apply_blas_flags
    from engines.core import blas

    for flags, expected in (((), "auto"), (("--cpu-kernels", "off"), "off")):
        monkeypatch.delenv(blas.KERNELS_ENV, raising=False)
        monkeypatch.setenv("TANDEM_BLAS", "auto")
        monkeypatch.setenv("TANDEM_GEMM_LAYOUT", "auto")
        apply_blas_flags(build_parser().parse_args(["serve", *KEY, *flags]))
        assert blas.cpu_kernels_choice() == expected
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", *KEY, "--cpu-kernels", "avx9000"])


def test_the_chat_template_file_is_read_with_the_flags(tmp_path: Path) -> None:
    template = tmp_path / "chat.jinja"
    template.write_text("{{ messages[0]['content'] }}")
    assert serve_config("--chat-template", str(template)).chat_template == template.read_text()
    assert serve_config().chat_template is None
    (tmp_path / "empty.jinja").write_text(" \n")
    for name, reason in (("empty.jinja", "is empty"), (".", "Is a directory")):
        with pytest.raises(ConfigError, match=reason):
            serve_config("--chat-template", str(tmp_path / name))


@pytest.mark.parametrize(
    ("flags", "env", "expected"),
    [
        pytest.param((), None, (16, True), id="unset-shrinks-to-fit"),
        pytest.param(("--max-batch", "16"), None, (16, False), id="given-as-the-default"),
        pytest.param(("--max-batch", "3"), None, (3, False), id="given"),
        pytest.param((), "4", (4, False), id="given-through-the-environment"),
    ],
)
def test_only_an_unset_max_batch_lets_the_planner_shrink_the_batch(
    flags: tuple[str, ...], env: str | None, expected: tuple[int, bool], monkeypatch
) -> None:
    if env is None:
        monkeypatch.delenv("TANDEM_MAX_BATCH", raising=False)
    else:
        monkeypatch.setenv("TANDEM_MAX_BATCH", env)
    config = serve_config(*flags)
    assert (config.engine.max_batch, config.shrink_batch) == expected


def test_a_max_batch_under_one_is_refused() -> None:
    with pytest.raises(ConfigError, match="--max-batch must be at least 1, got 0"):
        serve_config("--max-batch", "0")


def test_the_engine_flags_become_one_engine_options() -> None:
    """Every flag that configures an engine lands in config.engine, checked under its name,
    and travels from there whole (engines/cluster/launch.py adds only what the plan decides)."""
    from engines.core.engine_options import EngineOptions

    config = serve_config(
        "--max-batch", "3", "--kv-bits", "4", "--quantized-kv-start", "0",
        "--num-draft-tokens", "5", "--prefix-cache-disk-bytes", "1G", "--blas-threads", "2",
    )  # fmt: skip
    assert config.engine == EngineOptions(
        max_batch=3, kv_bits=4, quantized_kv_start=0, most_drafted=5,
        prefix_cache_disk_bytes=1 << 30, blas_threads=2,
    )  # fmt: skip
    with pytest.raises(ConfigError, match="--kv-bits must be 8, 4 or off, got '3'"):
        serve_config("--kv-bits", "3")
