"""Peer servers the benchmarks compare ignis against, built locally (nothing of theirs is committed)."""
