"""hvd-compress test suite."""
