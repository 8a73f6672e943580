"""Benchmarks, separate from the suite: `python -m tests.bench.NAME`.

tandem's engines are imported first, so that the optimized BLAS is under mlx in every
benchmark, whatever the order of a script's own imports (ruff sorts mlx before engines)."""

import engines  # noqa: F401
