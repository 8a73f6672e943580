"""Tests of the encrypted pipeline engine and its stages."""
