"""Compute kernels the engine calls.

Every kernel has a torch reference (runs anywhere, the oracle in tests). Faster
device versions (Triton on CUDA) plug in behind the same signatures; until one
exists for a kernel, the reference runs on every device.
"""
