"""Triton kernels; imported only where Triton is installed."""
