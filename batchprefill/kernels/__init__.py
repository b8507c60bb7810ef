"""Compute ops behind one interface: a plain torch path (CPU, reference) and Triton kernels (GPU)."""
