"""Benchmarks: each prints a table, ratios measured side by side in one run (see README, "Benchmarks")."""
