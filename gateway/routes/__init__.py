"""HTTP endpoints, one module each."""
