"""The Triton kernels of a continued prefill's padded rows (app.model.text.rows.ContinuedRows.padded): its attention
(app.model.text.prefill_attention.continued, which says what it computes), each prompt's rows against its own slot's
columns in the store, read in place; and its DeltaNet convolution and delta rule (app.model.text.ops.continued_conv
and continued_delta_steps), each from its slot's state, moved on in place.

Imported only on CUDA; tests run it on the CPU through Triton's interpreter.
"""

import torch
import triton
import triton.language as tl

from app.model.text.kernels import delta_rule_token


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


@triton.jit
def _continued_conv_kernel(x_ptr, x_row_stride, state_ptr, state_slot_stride, slots_ptr, lengths_ptr, weight_ptr,
                           out_ptr, channels, LENGTH: tl.constexpr, WIDTH: tl.constexpr, BLOCK_WIDTH: tl.constexpr,
                           BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
    # One program per (prompt, block of channels), over all the prompt's places: it reads the slot's kept inputs
    # and then writes them over, which no other program reads. An input at a place before the prompt's first is
    # the kept one that many places back (the state holds the last WIDTH inputs, the latest last).
    prompt = tl.program_id(0).to(tl.int64)
    channel = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    channel_mask = channel < channels
    kept_inputs = state_ptr + tl.load(slots_ptr + prompt) * state_slot_stride + channel * WIDTH
    first = prompt * LENGTH
    for start in range(0, LENGTH, BLOCK_T):
        place = start + tl.arange(0, BLOCK_T)
        place_mask = place < LENGTH
        total = tl.zeros([BLOCK_T, BLOCK_C], tl.float32)
        for tap in tl.static_range(WIDTH):
            source = place - (WIDTH - 1 - tap)
            new = tl.load(x_ptr + (first + source)[:, None] * x_row_stride + channel[None, :],
                          mask=(place_mask & (source >= 0))[:, None] & channel_mask[None, :], other=0.0)
            kept = tl.load(kept_inputs[None, :] + (WIDTH + source)[:, None],
                           mask=(place_mask & (source < 0))[:, None] & channel_mask[None, :], other=0.0)
            weight = tl.load(weight_ptr + channel * WIDTH + tap, mask=channel_mask, other=0.0).to(tl.float32)
            total += (new.to(tl.float32) + kept.to(tl.float32)) * weight[None, :]
        tl.store(out_ptr + (first + place)[:, None] * channels + channel[None, :],
                 (total * tl.sigmoid(total)).to(out_ptr.dtype.element_ty), mask=place_mask[:, None] & channel_mask[None, :])
    # The new state: the last WIDTH inputs up to the prompt's last real place.
    tap = tl.arange(0, BLOCK_WIDTH)
    source = tl.load(lengths_ptr + prompt) - WIDTH + tap
    taps = channel_mask[:, None] & (tap < WIDTH)[None, :]
    new = tl.load(x_ptr + (first + source)[None, :] * x_row_stride + channel[:, None], mask=taps & (source >= 0)[None, :],
                  other=0.0)
    kept = tl.load(kept_inputs[:, None] + (WIDTH + source)[None, :], mask=taps & (source < 0)[None, :], other=0.0)
    tl.debug_barrier()  # a prompt shorter than the window: this program's threads read the places written below
    tl.store(kept_inputs[:, None] + tap[None, :], (new.to(tl.float32) + kept.to(tl.float32)).to(state_ptr.dtype.element_ty),
             mask=taps)


def continued_conv(projection, channels, state, slots, lengths, weight):
    prompts, width = slots.shape[0], weight.shape[1]
    assert state.stride()[1:] == (width, 1)  # each slot's [channels, width] whole, as the addressing assumes
    out = torch.empty((projection.shape[0], channels), dtype=projection.dtype, device=projection.device)
    block_c = 64
    _continued_conv_kernel[(prompts, triton.cdiv(channels, block_c))](
        projection, projection.stride(0), state, state.stride(0), slots, lengths, weight, out, channels,
        LENGTH=projection.shape[0] // prompts, WIDTH=width, BLOCK_WIDTH=triton.next_power_of_2(width), BLOCK_T=16,
        BLOCK_C=block_c)
    return out


@triton.jit
def _continued_delta_steps_kernel(qkv_ptr, projection_ptr, projection_row_stride, beta_column, decay_column, a_log_ptr,
                                  dt_bias_ptr, state_ptr, state_slot_stride, slots_ptr, lengths_ptr, out_ptr, scale,
                                  LENGTH: tl.constexpr, KEY_HEADS: tl.constexpr, VALUE_HEADS: tl.constexpr,
                                  K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr):
    # app.model.text.kernels' one-token step, over a prompt's places one after another, its part of the slot's
    # state held in registers from the first to the last: read once and written once. Padding places leave it as
    # it is (their outputs are never read).
    program = tl.program_id(0).to(tl.int64)
    prompt_head = program // tl.cdiv(V, BV)
    prompt = prompt_head // VALUE_HEADS
    value_head = prompt_head % VALUE_HEADS
    key_head = value_head // (VALUE_HEADS // KEY_HEADS)
    k_index = tl.arange(0, BK)
    v_index = (program % tl.cdiv(V, BV)) * BV + tl.arange(0, BV)
    k_mask = k_index < K
    v_mask = v_index < V
    both = k_mask[:, None] & v_mask[None, :]
    state = state_ptr + tl.load(slots_ptr + prompt) * state_slot_stride + value_head * K * V \
        + k_index[:, None] * V + v_index[None, :]
    held = tl.load(state, mask=both, other=0.0)
    real = tl.load(lengths_ptr + prompt)
    for place in range(LENGTH):
        row = prompt * LENGTH + place
        updated, out = delta_rule_token(held, qkv_ptr + row * (2 * KEY_HEADS * K + VALUE_HEADS * V),
                                        projection_ptr + row * projection_row_stride, beta_column, decay_column,
                                        a_log_ptr, dt_bias_ptr, key_head, value_head, k_index, v_index, scale,
                                        KEY_HEADS, K, V)
        held = tl.where(place < real, updated, held)
        tl.store(out_ptr + (row * VALUE_HEADS + value_head) * V + v_index, out.to(out_ptr.dtype.element_ty), mask=v_mask)
    tl.store(state, held, mask=both)


def continued_delta_steps(qkv, projection, beta_column, decay_column, a_log, dt_bias, state, slots, lengths, key_heads):
    _, value_heads, k_dim, v_dim = state.shape
    assert state.stride()[1:] == (k_dim * v_dim, v_dim, 1) and qkv.is_contiguous()  # the addressing's layout
    prompts, rows = slots.shape[0], qkv.shape[0]
    out = torch.empty((rows, value_heads * v_dim), dtype=qkv.dtype, device=qkv.device)
    block_v = min(8, triton.next_power_of_2(v_dim))  # many programs: a wave holds few prompts
    _continued_delta_steps_kernel[(prompts * value_heads * triton.cdiv(v_dim, block_v),)](
        qkv, projection, projection.stride(0), beta_column, decay_column, a_log, dt_bias, state, state.stride(0), slots,
        lengths, out, k_dim ** -0.5, LENGTH=rows // prompts, KEY_HEADS=key_heads, VALUE_HEADS=value_heads, K=k_dim,
        V=v_dim, BK=triton.next_power_of_2(k_dim), BV=block_v, num_warps=1)
    return out
