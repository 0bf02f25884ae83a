"""Model definitions, checkpoint loading and the per-step forward batch."""
