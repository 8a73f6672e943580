"""Tests of launching, supervising and re-planning a cluster."""
