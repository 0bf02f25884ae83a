"""LoRA adapters served beside the base model: read (adapter.py), resident per linear (sites.py),
named and slotted (registry.py); their gRPC calls are engine/adapter_calls.py."""
