"""The text model: fused (Triton kernels with PyTorch references) beside transformers' layers."""
