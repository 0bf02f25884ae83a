"""The tierstore: the lower tiers (KV-RAM arena, KV-disk) below an engine's device memory.

Serves ``ignis.v1.TierStore`` (protos/ignis/v1/tierstore.proto). Never imports
engine/ or gateway/ code; see README.md in this folder for the API.
"""
