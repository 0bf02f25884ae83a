"""ignis engine: the model host."""
