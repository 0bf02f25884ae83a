"""The engine's side of the lower tiers (KV-RAM, KV-disk): a client of ignis.v1.TierStore.

The engine never imports tierstore/: the two meet only in protos/ (ignis.v1.tierstore_pb2).
"""
