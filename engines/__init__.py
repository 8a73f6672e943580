"""What runs the model: the Engine interface, single / tp / pp engines, and the HTTP API."""

from engines.core import blas, import_index

blas.activate()  # before any module below can import mlx: mlx must bind to the optimized BLAS
import_index.install()  # before any module below can import transformers
