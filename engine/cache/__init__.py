"""Device-side cache state: the KV page pool, recurrent-state slots, reuse indexes."""
