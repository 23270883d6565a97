"""The Triton kernel of a continued prefill's attention (app.model.text.prefill_attention.continued, which says
what it computes): each prompt's padded rows against its own slot's columns in the store, read in place.

Imported only on CUDA; tests run it on the CPU through Triton's interpreter.
"""

import torch
import triton
import triton.language as tl


@triton.jit
def _continued_attention_kernel(query_ptr, keys_ptr, values_ptr, slots_ptr, starts_ptr, lengths_ptr, out_ptr, scale,
                                length, cache_slot_stride, cache_head_stride, HEADS: tl.constexpr,
                                GROUP: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    # One program per (prompt, key head, block of BLOCK_M query rows): the key head's GROUP query heads at each of
    # the block's places are its rows (place * GROUP + head), so each key is read once for all of them. A row at
    # place p reads its slot's columns [0, start + p]: the kept conversation, then the new tokens up to itself.
    prompt = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    block = tl.program_id(2)
    rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
    place = rows // GROUP
    d = tl.arange(0, D)
    at = ((prompt * length + place) * HEADS + kv_head * GROUP + rows % GROUP)[:, None] * D + d[None, :]
    inside = (place < length)[:, None]
    if block * BLOCK_M // GROUP >= tl.load(lengths_ptr + prompt):
        # Padding places only: their output is never read, but must be finite (it flows on through their rows).
        tl.store(out_ptr + at, tl.zeros([BLOCK_M, D], out_ptr.dtype.element_ty), mask=inside)
    else:
        start = tl.load(starts_ptr + prompt)
        cache = tl.load(slots_ptr + prompt).to(tl.int64) * cache_slot_stride + kv_head * cache_head_stride
        query = tl.load(query_ptr + at, mask=inside, other=0.0)
        last = start + place  # each row's last column
        end = start + tl.minimum(((block + 1) * BLOCK_M - 1) // GROUP + 1, length)  # past the block's last row's
        best = tl.full([BLOCK_M], float("-inf"), tl.float32)
        total = tl.zeros([BLOCK_M], tl.float32)
        out = tl.zeros([BLOCK_M, D], tl.float32)
        for first in tl.range(0, end, BLOCK_N):
            columns = first + tl.arange(0, BLOCK_N)
            read = (columns < end)[:, None]
            keys = tl.load(keys_ptr + cache + columns[:, None] * D + d[None, :], mask=read, other=0.0)
            scores = tl.dot(query, tl.trans(keys)) * scale
            scores = tl.where(columns[None, :] <= last[:, None], scores, float("-inf"))
            new_best = tl.maximum(best, tl.max(scores, axis=1))
            weights = tl.exp(scores - new_best[:, None])
            shrink = tl.exp(best - new_best)
            values = tl.load(values_ptr + cache + columns[:, None] * D + d[None, :], mask=read, other=0.0)
            out = out * shrink[:, None] + tl.dot(weights.to(values.dtype), values)
            total = total * shrink + tl.sum(weights, axis=1)
            best = new_best
        tl.store(out_ptr + at, (out / total[:, None]).to(out_ptr.dtype.element_ty), mask=inside)


# Query rows (places times the query heads of a key head) and columns a program takes at a time, its warps and
# pipeline stages (docs/DECISIONS.md D61).
CONTINUED_LAYOUT = (64, 64, 4, 2)


def continued_attention(query, keys, values, slots, starts, lengths, scale, layout=None, out=None):
    """`layout`: (rows, columns, warps, stages) a program, CONTINUED_LAYOUT's by default; `out`: where to write
    (a new tensor by default)."""
    n, heads, head_dim = query.shape
    prompts, kv_heads = slots.shape[0], keys.shape[1]
    length, group = n // prompts, heads // kv_heads
    block_m, block_n, warps, stages = layout or CONTINUED_LAYOUT
    # What the kernel's addressing assumes: rows of a column's head dimension one after another, keys and values
    # laid out alike, queries whole.
    assert keys.stride()[2:] == (head_dim, 1) and values.stride() == keys.stride() and query.is_contiguous()
    out = torch.empty((n, heads * head_dim), dtype=query.dtype, device=query.device) if out is None else out
    _continued_attention_kernel[(prompts, kv_heads, triton.cdiv(length * group, block_m))](
        query, keys, values, slots, starts, lengths, out, scale, length, keys.stride(0), keys.stride(1), HEADS=heads,
        GROUP=group, D=head_dim, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps, num_stages=stages)
    return out
