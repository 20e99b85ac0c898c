"""Functions that run on every rank of a multi-process test (see tests/harness.py)."""
