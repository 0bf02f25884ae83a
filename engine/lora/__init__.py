"""LoRA adapters served beside the base model: read (adapter.py), resident per linear (sites.py),
named and slotted (registry.py)."""
