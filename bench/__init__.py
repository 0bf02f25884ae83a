"""Benchmarks: each prints a table and compares against a baseline measured in the same run."""
