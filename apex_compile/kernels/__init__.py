"""Triton GPU kernels for the decoder layer (each runs on CPU tensors under TRITON_INTERPRET=1)."""
