"""Triton kernels of the fused vision tower: each does in one launch what app.engine.vision_ops does in
PyTorch in several (see there for what each computes). Math in fp32, one rounding at the end.

Imported only on CUDA; tests run these kernels on the CPU through Triton's interpreter.
"""

import torch
import triton
import triton.language as tl


@triton.jit
def _add_layer_norm_kernel(x_ptr, residual_ptr, weight_ptr, bias_ptr, out_ptr, residual_out_ptr, width, eps,
                           HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < width
    x = tl.load(x_ptr + row * width + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        residual = tl.load(residual_ptr + row * width + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + residual.to(tl.float32)).to(residual_out_ptr.dtype.element_ty)
        tl.store(residual_out_ptr + row * width + cols, x, mask=mask)
    hidden = x.to(tl.float32)
    centred = tl.where(mask, hidden - tl.sum(hidden, axis=0) / width, 0.0)
    inverse_std = tl.rsqrt(tl.sum(centred * centred, axis=0) / width + eps)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    bias = tl.load(bias_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * width + cols, (centred * inverse_std * weight + bias).to(out_ptr.dtype.element_ty),
             mask=mask)


def add_layer_norm(x, residual, weight, bias, eps):
    rows, width = x.shape
    normed = torch.empty_like(x)
    new_residual = x if residual is None else torch.empty_like(x)
    _add_layer_norm_kernel[(rows,)](x, residual if residual is not None else x, weight, bias, normed, new_residual,
                                    width, eps, HAS_RESIDUAL=residual is not None, BLOCK=triton.next_power_of_2(width))
    return normed, new_residual


@triton.jit
def _window_attention_kernel(qkv_ptr, out_ptr, tokens, hidden, head_dim, scale, WINDOW: tl.constexpr,
                             BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    """BLOCK_T tokens (whole windows) of one head: a BLOCK_T x BLOCK_T score block with everything
    outside each token's own window masked (the products are tiny; the loads are what costs)."""
    head = tl.program_id(1)
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    dims = tl.arange(0, BLOCK_D)
    mask = (rows[:, None] < tokens) & (dims[None, :] < head_dim)
    at = qkv_ptr + rows[:, None].to(tl.int64) * (3 * hidden) + head * head_dim + dims[None, :]
    query = tl.load(at, mask=mask, other=0.0)
    key = tl.load(at + hidden, mask=mask, other=0.0)
    value = tl.load(at + 2 * hidden, mask=mask, other=0.0)
    scores = tl.dot(query, tl.trans(key)) * scale
    same_window = (rows[:, None] // WINDOW) == (rows[None, :] // WINDOW)
    scores = tl.where(same_window, scores, float("-inf"))
    weights = tl.exp(scores - tl.max(scores, axis=1)[:, None])
    weights = weights / tl.sum(weights, axis=1)[:, None]
    out = tl.dot(weights.to(value.dtype), value)
    tl.store(out_ptr + rows[:, None].to(tl.int64) * hidden + head * head_dim + dims[None, :],
             out.to(out_ptr.dtype.element_ty), mask=mask)


def window_attention(qkv, heads, window, scale):
    tokens, hidden = qkv.shape[0], qkv.shape[1] // 3
    out = torch.empty((tokens, hidden), dtype=qkv.dtype, device=qkv.device)
    block = 16 * window
    _window_attention_kernel[(triton.cdiv(tokens, block), heads)](
        qkv, out, tokens, hidden, hidden // heads, scale, WINDOW=window, BLOCK_T=block,
        BLOCK_D=max(16, triton.next_power_of_2(hidden // heads)))
    return out
