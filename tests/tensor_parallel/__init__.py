"""Tests of the tensor-parallel engine and its ranks."""
