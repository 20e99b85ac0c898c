"""Parameter server for sparse gradient aggregation."""
