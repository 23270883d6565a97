"""Triton kernels of the fused vision tower: each does in one launch what app.model.vision.ops does in
PyTorch in several (see there for what each computes). Math in fp32, one rounding at the end.

Imported only on CUDA; tests run these kernels on the CPU through Triton's interpreter.
"""

import torch
import triton
import triton.language as tl

from app.model.text import kernels as text_kernels


def add_layer_norm(x, residual, weight, bias, eps):
    return text_kernels.add_norm(x, residual, weight, bias, eps)  # the text model's kernel, centred and with a bias


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
