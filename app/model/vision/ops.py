"""The operations of the fused vision tower (app.model.vision.fused) that PyTorch does in several kernels.

One Triton kernel each on CUDA (app.model.vision.kernels), where Triton runs (the probe is the text
model's: app.model.text.ops.triton_kernels); plain PyTorch elsewhere. The PyTorch versions are the
reference and follow transformers' SigLIP layers operation for operation.

Shapes: rows of tokens; `qkv` is a merged query/key/value projection [tokens, 3 * hidden].
"""

import torch
import torch.nn.functional as F

from app.model.text import ops as text_ops


def _kernels_for(tensor: torch.Tensor):
    if not tensor.is_cuda or text_ops.triton_kernels(tensor.device) is None:
        return None
    from app.model.vision import kernels as vision_kernels

    return vision_kernels


def add_layer_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, bias: torch.Tensor,
                   eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(LayerNorm of residual + x, the new residual): the sum in x's dtype, as the model adds it."""
    kernels = _kernels_for(x)
    if kernels is not None:
        return kernels.add_layer_norm(x, residual, weight, bias, eps)
    if residual is not None:
        x = residual + x
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps), x


def linear_gelu_tanh(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """gelu_pytorch_tanh(x @ weight.T + bias). On CUDA the GELU is the matrix product's epilogue in
    cuBLASLt (PyTorch's _addmm_activation, whose CUDA GELU is the tanh form), which saves a pass over
    the MLP's widest activations; on the CPU that function's GELU is the exact one, so not there."""
    if x.is_cuda:
        return torch._addmm_activation(bias, x, weight.t(), use_gelu=True)
    return F.gelu(F.linear(x, weight, bias), approximate="tanh")


def window_attention(qkv: torch.Tensor, heads: int, window: int, scale: float) -> torch.Tensor:
    """Attention within each run of `window` consecutive tokens (the window merger's 2x2 windows, put
    side by side beforehand). Returns [tokens, hidden]. SDPA gives each window and head a thread block
    of its own (23 ms for a 32-image wave's 81,920 windows on an H200); the kernel takes 16 windows at a time."""
    kernels = _kernels_for(qkv)
    if kernels is not None and not window & (window - 1):  # its blocks hold whole windows: powers of two
        return kernels.window_attention(qkv, heads, window, scale)
    tokens, hidden = qkv.shape[0], qkv.shape[1] // 3
    query, key, value = qkv.view(tokens // window, window, 3, heads, hidden // heads).unbind(2)
    attended = F.scaled_dot_product_attention(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2),
                                              scale=scale)
    return attended.transpose(1, 2).reshape(tokens, hidden)
