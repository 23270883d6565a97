"""The vision tower: fused (Triton kernels with PyTorch references) beside transformers' modules."""
