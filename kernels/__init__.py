"""Compute kernels the engine calls.

Every kernel has a torch reference (paged_attention.py, gated_delta.py, causal_conv.py,
state_copy.py: runs anywhere, the oracle in tests) and a Triton version behind the same
signature (triton_*.py, CUDA only). select.py is the one place that picks: kernels_for(device)
gives the Triton kernels on CUDA and the references elsewhere; Triton is imported only then.
"""
