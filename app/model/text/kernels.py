"""Triton kernels of the fused text model: each does in one launch what app.model.text.ops does in
PyTorch in several (see there for what each computes). Math in fp32, one rounding at the end.

Imported only on CUDA; tests run these kernels on the CPU through Triton's interpreter.
"""

import torch
import triton
import triton.language as tl


@triton.jit
def add_norm_kernel(x_ptr, residual_ptr, weight_ptr, bias_ptr, out_ptr, residual_out_ptr, width, eps,
                    HAS_RESIDUAL: tl.constexpr, LAYER_NORM: tl.constexpr, BLOCK: tl.constexpr):
    """A row's residual add, then RMSNorm, or LayerNorm with a bias (LAYER_NORM: app.model.vision.kernels)."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < width
    x = tl.load(x_ptr + row * width + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        residual = tl.load(residual_ptr + row * width + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + residual.to(tl.float32)).to(residual_out_ptr.dtype.element_ty)
        tl.store(residual_out_ptr + row * width + cols, x, mask=mask)
    hidden = x.to(tl.float32)
    if LAYER_NORM:
        hidden = tl.where(mask, hidden - tl.sum(hidden, axis=0) / width, 0.0)
    normed = hidden * tl.rsqrt(tl.sum(hidden * hidden, axis=0) / width + eps)
    normed *= tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if LAYER_NORM:
        normed += tl.load(bias_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * width + cols, normed.to(out_ptr.dtype.element_ty), mask=mask)


def add_norm(x, residual, weight, bias, eps):
    """add_norm_kernel over the rows of x: (normed, the new residual); a LayerNorm when `bias` is given."""
    rows, width = x.shape
    normed = torch.empty_like(x)
    new_residual = x if residual is None else torch.empty_like(x)
    add_norm_kernel[(rows,)](x, residual if residual is not None else x, weight, bias if bias is not None else weight,
                             normed, new_residual, width, eps, HAS_RESIDUAL=residual is not None,
                             LAYER_NORM=bias is not None, BLOCK=triton.next_power_of_2(width))
    return normed, new_residual


def add_rms_norm(x, residual, weight, eps):
    return add_norm(x, residual, weight, None, eps)


@triton.jit
def _conv_step_kernel(x_ptr, x_row_stride, state_ptr, weight_ptr, out_ptr, channels,
                      WIDTH: tl.constexpr, BLOCK_WIDTH: tl.constexpr, BLOCK: tl.constexpr):
    # Each channel's window (its state's last WIDTH - 1 inputs, then x) is read and written as one
    # [BLOCK, WIDTH] tile of the state: tap by tap, each load and store took one element in WIDTH
    # (docs/DECISIONS.md D60).
    row = tl.program_id(0).to(tl.int64)
    channel = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    tap = tl.arange(0, BLOCK_WIDTH)
    mask = channel < channels
    taps = mask[:, None] & (tap[None, :] < WIDTH)
    x = tl.load(x_ptr + row * x_row_stride + channel, mask=mask, other=0.0)
    state = state_ptr + (row * channels + channel[:, None]) * WIDTH + tap[None, :]
    kept = tl.load(state + 1, mask=mask[:, None] & (tap[None, :] < WIDTH - 1), other=0.0).to(tl.float32)
    window = tl.where(tap[None, :] == WIDTH - 1, x[:, None].to(tl.float32), kept)
    weight = tl.load(weight_ptr + channel[:, None] * WIDTH + tap[None, :], mask=taps, other=0.0)
    total = tl.sum(window * weight.to(tl.float32), axis=1)
    tl.store(state, window.to(state_ptr.dtype.element_ty), mask=taps)
    tl.store(out_ptr + row * channels + channel, (total * tl.sigmoid(total)).to(out_ptr.dtype.element_ty), mask=mask)


def conv_step(projection, channels, state, weight):
    n = projection.shape[0]
    out = torch.empty((n, channels), dtype=projection.dtype, device=projection.device)
    block = 256
    _conv_step_kernel[(n, triton.cdiv(channels, block))](projection, projection.stride(0), state, weight, out,
                                                         channels, WIDTH=state.shape[-1],
                                                         BLOCK_WIDTH=triton.next_power_of_2(state.shape[-1]), BLOCK=block)
    return out


@triton.jit
def _packed_conv_kernel(x_ptr, x_row_stride, positions_ptr, weight_ptr, out_ptr, tokens, channels,
                        WIDTH: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
    token = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    channel = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    token_mask = token < tokens
    channel_mask = channel < channels
    position = tl.load(positions_ptr + token, mask=token_mask, other=0)
    total = tl.zeros([BLOCK_T, BLOCK_C], tl.float32)
    for tap in tl.static_range(WIDTH):
        back = WIDTH - 1 - tap
        inside = token_mask & (position >= back)  # earlier tokens of the same prompt only
        x = tl.load(x_ptr + (token - back)[:, None] * x_row_stride + channel[None, :],
                    mask=inside[:, None] & channel_mask[None, :], other=0.0)
        weight = tl.load(weight_ptr + channel * WIDTH + tap, mask=channel_mask, other=0.0)
        total += x.to(tl.float32) * weight.to(tl.float32)[None, :]
    out = (total * tl.sigmoid(total)).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + token[:, None] * channels + channel[None, :], out, mask=token_mask[:, None] & channel_mask[None, :])


def packed_conv(projection, channels, weight, positions):
    tokens = projection.shape[0]
    out = torch.empty((tokens, channels), dtype=projection.dtype, device=projection.device)
    block_t, block_c = 16, 128
    _packed_conv_kernel[(triton.cdiv(tokens, block_t), triton.cdiv(channels, block_c))](
        projection, projection.stride(0), positions, weight, out, tokens, channels, WIDTH=weight.shape[1],
        BLOCK_T=block_t, BLOCK_C=block_c)
    return out


@triton.jit
def delta_rule_token(held, qkv, projection, beta_column, decay_column, a_log_ptr, dt_bias_ptr, key_head, value_head,
                     k_index, v_index, scale, KEY_HEADS: tl.constexpr, K: tl.constexpr, V: tl.constexpr):
    """One token of the gated delta rule on a block `held` [BK, BV] of a value head's fp32 state, from the token's
    rows of convolved queries, keys and values (`qkv`) and of the projection: (the block after it, its output)."""
    query = tl.load(qkv + key_head * K + k_index, mask=k_index < K, other=0.0).to(tl.float32)
    key = tl.load(qkv + KEY_HEADS * K + key_head * K + k_index, mask=k_index < K, other=0.0).to(tl.float32)
    value = tl.load(qkv + 2 * KEY_HEADS * K + value_head * V + v_index, mask=v_index < V, other=0.0).to(tl.float32)
    query = query / tl.sqrt(tl.sum(query * query, axis=0) + 1e-6) * scale
    key = key / tl.sqrt(tl.sum(key * key, axis=0) + 1e-6)
    beta = tl.sigmoid(tl.load(projection + beta_column + value_head).to(tl.float32))
    raw = tl.load(projection + decay_column + value_head).to(tl.float32) + tl.load(dt_bias_ptr + value_head).to(tl.float32)
    softplus = tl.where(raw > 20.0, raw, tl.log(1.0 + tl.exp(raw)))  # PyTorch's softplus threshold
    held = held * tl.exp(-tl.exp(tl.load(a_log_ptr + value_head).to(tl.float32)) * softplus)
    delta = beta * (value - tl.sum(held * key[:, None], axis=0))
    held += key[:, None] * delta[None, :]
    return held, tl.sum(held * query[:, None], axis=0)


@triton.jit
def _gated_delta_step_kernel(qkv_ptr, projection_ptr, projection_row_stride, beta_column, decay_column, a_log_ptr,
                             dt_bias_ptr, state_ptr, columns_ptr, out_ptr, scale, KEY_HEADS: tl.constexpr,
                             VALUE_HEADS: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr,
                             BV: tl.constexpr):
    # One program per (sequence and value head, block of BV value columns): it owns that part of the state.
    # Neighbouring programs take neighbouring blocks of one state row: at batch 200 this order ran 2.8x
    # faster than blocks of one head far apart in the grid (the state is read and written once a step).
    # A row at column 0 is a captured step's padding: it reads and writes no state (docs/DECISIONS.md D60).
    program = tl.program_id(0).to(tl.int64)
    sequence_head = program // tl.cdiv(V, BV)
    row = sequence_head // VALUE_HEADS
    live = tl.load(columns_ptr + row) > 0
    value_head = sequence_head % VALUE_HEADS
    key_head = value_head // (VALUE_HEADS // KEY_HEADS)
    k_index = tl.arange(0, BK)
    v_index = (program % tl.cdiv(V, BV)) * BV + tl.arange(0, BV)
    state = state_ptr + sequence_head * K * V + k_index[:, None] * V + v_index[None, :]
    both = (k_index < K)[:, None] & (v_index < V)[None, :] & live
    held, out = delta_rule_token(tl.load(state, mask=both, other=0.0), qkv_ptr + row * (2 * KEY_HEADS * K + VALUE_HEADS * V),
                                 projection_ptr + row * projection_row_stride, beta_column, decay_column, a_log_ptr,
                                 dt_bias_ptr, key_head, value_head, k_index, v_index, scale, KEY_HEADS, K, V)
    tl.store(state, held, mask=both)
    tl.store(out_ptr + sequence_head * V + v_index, out.to(out_ptr.dtype.element_ty), mask=v_index < V)


def delta_step_layout(rows: int) -> tuple[int, int]:
    """(value columns a program, warps a program) for `rows` sequences. Many rows: 64 columns and 4 warps
    read and write the states at 3.9 TB/s on an H200, near a plain in-place multiply's 4.1 (8 columns and
    one warp: 2.7). Few rows: 8 columns, for enough programs to fill the card (benchmarks/experiments/delta_step.py)."""
    return (8, 1) if rows < 32 else (64, 4)


def gated_delta_step(qkv, projection, beta_column, decay_column, a_log, dt_bias, state, key_heads, columns,
                     layout=None):
    """`layout`: (value columns a program, warps), delta_step_layout's by default."""
    n, value_heads, k_dim, v_dim = state.shape
    out = torch.empty((n, value_heads * v_dim), dtype=qkv.dtype, device=qkv.device)
    block_v, warps = layout or delta_step_layout(n)
    block_v = min(block_v, triton.next_power_of_2(v_dim))
    _gated_delta_step_kernel[(n * value_heads * triton.cdiv(v_dim, block_v),)](
        qkv, projection, projection.stride(0), beta_column, decay_column, a_log, dt_bias, state, columns, out,
        k_dim ** -0.5,
        KEY_HEADS=key_heads, VALUE_HEADS=value_heads, K=k_dim, V=v_dim, BK=triton.next_power_of_2(k_dim), BV=block_v,
        num_warps=warps)
    return out


@triton.jit
def _gated_rms_norm_kernel(x_ptr, projection_ptr, projection_row_stride, gate_column, weight_ptr, out_ptr, eps,
                           HEADS: tl.constexpr, D: tl.constexpr, BD: tl.constexpr):
    sequence_head = tl.program_id(0).to(tl.int64)
    row = sequence_head // HEADS
    head = sequence_head % HEADS
    d = tl.arange(0, BD)
    mask = d < D
    x = tl.load(x_ptr + sequence_head * D + d, mask=mask, other=0.0).to(tl.float32)
    gate = tl.load(projection_ptr + row * projection_row_stride + gate_column + head * D + d, mask=mask,
                   other=0.0).to(tl.float32)
    weight = tl.load(weight_ptr + d, mask=mask, other=0.0).to(tl.float32)
    normed = x * tl.rsqrt(tl.sum(x * x, axis=0) / D + eps) * weight
    out = (normed * gate * tl.sigmoid(gate)).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + sequence_head * D + d, out, mask=mask)


def gated_rms_norm(x, projection, gate_column, weight, eps):
    n, width = x.shape
    head_dim = weight.shape[0]
    out = torch.empty_like(x)
    _gated_rms_norm_kernel[(n * (width // head_dim),)](x, projection, projection.stride(0), gate_column, weight, out,
                                                       eps, HEADS=width // head_dim, D=head_dim,
                                                       BD=triton.next_power_of_2(head_dim))
    return out


@triton.jit
def _silu_and_mul_kernel(gate_up_ptr, out_ptr, width, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < width
    gate = tl.load(gate_up_ptr + row * 2 * width + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_up_ptr + row * 2 * width + width + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * width + cols, (gate * tl.sigmoid(gate) * up).to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(gate_up):
    n, double = gate_up.shape
    out = torch.empty((n, double // 2), dtype=gate_up.dtype, device=gate_up.device)
    block = 1024
    _silu_and_mul_kernel[(n, triton.cdiv(double // 2, block))](gate_up, out, double // 2, BLOCK=block)
    return out


@triton.jit
def _attention_inputs_kernel(projection_ptr, projection_row_stride, q_norm_ptr, k_norm_ptr, eps, inv_freq_ptr,
                             rope_scaling, rope_positions_ptr, slots_ptr, columns_ptr, keys_ptr, values_ptr,
                             cache_slot_stride, cache_head_stride, query_ptr, HEADS: tl.constexpr, KV_HEADS: tl.constexpr,
                             D: tl.constexpr, ROTARY: tl.constexpr):
    # One program per (sequence, head): heads [0, HEADS) are queries, the next KV_HEADS keys (with values).
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    d = tl.arange(0, D)
    half = ROTARY // 2
    rotary = d < ROTARY
    partner = tl.where(d < half, d + half, d - half)  # what rotate_half brings to d
    projection = projection_ptr + row * projection_row_stride
    is_query = head < HEADS
    kv_head = head - HEADS
    source = tl.where(is_query, head * 2 * D, HEADS * 2 * D + kv_head * D)
    weight = tl.where(is_query, tl.load(q_norm_ptr + d), tl.load(k_norm_ptr + d))
    weight_partner = tl.where(is_query, tl.load(q_norm_ptr + partner), tl.load(k_norm_ptr + partner))
    x = tl.load(projection + source + d).to(tl.float32)
    x_partner = tl.load(projection + source + partner, mask=rotary, other=0.0).to(tl.float32)
    inverse_rms = tl.rsqrt(tl.sum(x * x, axis=0) / D + eps)
    normed = x * inverse_rms * weight
    normed_partner = x_partner * inverse_rms * weight_partner
    angle = tl.load(rope_positions_ptr + row).to(tl.float32) * tl.load(inv_freq_ptr + d % half, mask=rotary, other=0.0)
    cos = tl.cos(angle) * rope_scaling
    sin = tl.sin(angle) * rope_scaling
    turned = tl.where(d < half, normed * cos - normed_partner * sin, normed * cos + normed_partner * sin)
    out = tl.where(rotary, turned, normed)
    if is_query:
        tl.store(query_ptr + (row * HEADS + head) * D + d, out.to(query_ptr.dtype.element_ty))
    else:
        column = tl.load(columns_ptr + row)
        at = tl.load(slots_ptr + row) * cache_slot_stride + kv_head * cache_head_stride + column * D + d
        tl.store(keys_ptr + at, out.to(keys_ptr.dtype.element_ty))
        value = tl.load(projection + HEADS * 2 * D + KV_HEADS * D + kv_head * D + d)
        tl.store(values_ptr + at, value.to(values_ptr.dtype.element_ty))


def attention_inputs(projection, heads, kv_heads, head_dim, q_norm, k_norm, eps, inv_freq, rope_scaling,
                     rope_positions, slots, columns, keys, values):
    n = projection.shape[0]
    if head_dim != triton.next_power_of_2(head_dim):
        raise ValueError(f"head_dim {head_dim} must be a power of two for the fused decode step")
    query = torch.empty((n, heads, head_dim), dtype=projection.dtype, device=projection.device)
    _attention_inputs_kernel[(n, heads + kv_heads)](
        projection, projection.stride(0), q_norm, k_norm, eps, inv_freq, rope_scaling, rope_positions, slots,
        columns, keys, values, keys.stride(0), keys.stride(1), query, HEADS=heads, KV_HEADS=kv_heads, D=head_dim,
        ROTARY=2 * inv_freq.shape[0])
    return query


@triton.jit
def _attention_part_kernel(query_ptr, keys_ptr, values_ptr, positions_ptr, part_ptr, part_lse_ptr, scale,
                           cache_slot_stride, cache_head_stride, HEADS: tl.constexpr, GROUP: tl.constexpr,
                           BLOCK_GROUP: tl.constexpr, D: tl.constexpr, PARTS: tl.constexpr, CHUNK: tl.constexpr,
                           BLOCK_N: tl.constexpr):
    # One program per (sequence, key head, part of the columns): the key head's GROUP query heads against
    # its columns [part * CHUNK, (part + 1) * CHUNK) up to the sequence's own; attention split this way
    # keeps the whole GPU busy for one sequence (flash-decoding). A part past a sequence's length reads
    # and writes nothing: the join reads only the parts a sequence reaches.
    row = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    part = tl.program_id(2)
    last = tl.load(positions_ptr + row)
    if part * CHUNK <= last:
        g = tl.arange(0, BLOCK_GROUP)
        d = tl.arange(0, D)
        heads = kv_head * GROUP + g
        query = tl.load(query_ptr + (row * HEADS + heads[:, None]) * D + d[None, :], mask=(g < GROUP)[:, None],
                        other=0.0)
        cache = row * cache_slot_stride + kv_head * cache_head_stride
        best = tl.full([BLOCK_GROUP], float("-inf"), tl.float32)
        total = tl.zeros([BLOCK_GROUP], tl.float32)
        out = tl.zeros([BLOCK_GROUP, D], tl.float32)
        for start in tl.range(part * CHUNK, tl.minimum(part * CHUNK + CHUNK, last + 1), BLOCK_N):
            columns = start + tl.arange(0, BLOCK_N)
            seen = columns <= last
            keys = tl.load(keys_ptr + cache + columns[:, None] * D + d[None, :], mask=seen[:, None], other=0.0)
            scores = tl.dot(query, tl.trans(keys)) * scale
            scores = tl.where(seen[None, :], scores, float("-inf"))
            new_best = tl.maximum(best, tl.max(scores, axis=1))
            weights = tl.exp(scores - new_best[:, None])
            shrink = tl.exp(best - new_best)
            values = tl.load(values_ptr + cache + columns[:, None] * D + d[None, :], mask=seen[:, None], other=0.0)
            out = out * shrink[:, None] + tl.dot(weights.to(values.dtype), values)
            total = total * shrink + tl.sum(weights, axis=1)
            best = new_best
        where = (row * HEADS + heads) * PARTS + part
        mask = g < GROUP
        tl.store(part_ptr + where[:, None] * D + d[None, :], out / total[:, None], mask=mask[:, None])
        tl.store(part_lse_ptr + where, best + tl.log(total), mask=mask)


@triton.jit
def _attention_join_kernel(part_ptr, part_lse_ptr, positions_ptr, projection_ptr, projection_row_stride, out_ptr,
                           HEADS: tl.constexpr, D: tl.constexpr, PARTS: tl.constexpr, CHUNK: tl.constexpr):
    # The parts one (sequence, head) reaches, weighted by their softmax mass, times the head's output gate.
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    parts = tl.arange(0, PARTS)
    d = tl.arange(0, D)
    reached = parts * CHUNK <= tl.load(positions_ptr + row)
    lse = tl.load(part_lse_ptr + (row * HEADS + head) * PARTS + parts, mask=reached, other=float("-inf"))
    weights = tl.exp(lse - tl.max(lse, axis=0))
    outs = tl.load(part_ptr + ((row * HEADS + head) * PARTS + parts[:, None]) * D + d[None, :], mask=reached[:, None],
                   other=0.0)
    attended = tl.sum(outs * weights[:, None], axis=0) / tl.sum(weights, axis=0)
    gate = tl.load(projection_ptr + row * projection_row_stride + head * 2 * D + D + d).to(tl.float32)
    tl.store(out_ptr + (row * HEADS + head) * D + d, (attended * tl.sigmoid(gate)).to(out_ptr.dtype.element_ty))


# How the decode step's attention splits its work: parts of at least ATTENTION_PART_COLUMNS columns, at most
# MAX_ATTENTION_PARTS of them (a power of two), ATTENTION_BLOCK columns per inner step; two pipeline stages were
# faster than three on an H100 (D46, D55).
ATTENTION_PART_COLUMNS = 128
MAX_ATTENTION_PARTS = 16
ATTENTION_BLOCK = 64
ATTENTION_WARPS = 4
ATTENTION_STAGES = 2


def attention_layout(capacity: int) -> tuple[int, int, int, int]:
    """(parts, columns per inner step, warps, pipeline stages) for a store of `capacity` columns a slot."""
    parts = min(MAX_ATTENTION_PARTS, triton.next_power_of_2(triton.cdiv(capacity, ATTENTION_PART_COLUMNS)))
    return parts, ATTENTION_BLOCK, ATTENTION_WARPS, ATTENTION_STAGES


def attend(query, keys, values, positions, scale, projection, layout=None):
    """`layout`: attention_layout's by default."""
    n, heads, head_dim = query.shape
    kv_heads, capacity = keys.shape[1], keys.shape[2]
    parts, block_n, warps, stages = layout or attention_layout(capacity)
    chunk = triton.cdiv(triton.cdiv(capacity, parts), block_n) * block_n
    part = torch.empty((n, heads, parts, head_dim), dtype=torch.float32, device=query.device)
    part_lse = torch.empty((n, heads, parts), dtype=torch.float32, device=query.device)
    group = heads // kv_heads
    _attention_part_kernel[(n, kv_heads, parts)](
        query, keys, values, positions, part, part_lse, scale, keys.stride(0), keys.stride(1), HEADS=heads,
        GROUP=group, BLOCK_GROUP=max(16, triton.next_power_of_2(group)), D=head_dim, PARTS=parts, CHUNK=chunk,
        BLOCK_N=block_n, num_warps=warps, num_stages=stages)
    out = torch.empty((n, heads * head_dim), dtype=query.dtype, device=query.device)
    _attention_join_kernel[(n, heads)](part, part_lse, positions, projection, projection.stride(0), out, HEADS=heads,
                                       D=head_dim, PARTS=parts, CHUNK=chunk)
    return out


@triton.jit
def _one_row_linear_kernel(x_ptr, weight_ptr, out_ptr, out_features, in_features,
                           BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """out[BLOCK_N outputs] = weight[outputs] @ x for one row x: a GEMV, each weight row read once."""
    outputs = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    output_mask = outputs < out_features
    total = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for start in range(0, in_features, BLOCK_K):
        cols = start + tl.arange(0, BLOCK_K)
        col_mask = cols < in_features
        weight = tl.load(weight_ptr + outputs.to(tl.int64)[:, None] * in_features + cols[None, :],
                         mask=output_mask[:, None] & col_mask[None, :], other=0.0)
        x = tl.load(x_ptr + cols, mask=col_mask, other=0.0)
        total += tl.sum(weight.to(tl.float32) * x.to(tl.float32)[None, :], axis=1)
    tl.store(out_ptr + outputs, total.to(out_ptr.dtype.element_ty), mask=output_mask)


def one_row_layout(out_features: int, in_features: int) -> tuple[int, int, int]:
    """(outputs, inputs a step, warps) of a program of _one_row_linear_kernel: two outputs, so that there
    are programs enough for every SM to keep many weight loads in flight, and up to 2048 inputs a step,
    the best of the layouts swept on an H200 at the 4.6 shapes (docs/DECISIONS.md D44)."""
    step = min(2048, triton.next_power_of_2(in_features))
    return 2, step, 4 if step <= 1024 else 8


def linear(x, weight, layout=None):
    """x [1, in] @ weight [out, in].T (a decode step of one reply), in x's dtype."""
    out_features, in_features = weight.shape
    outputs, step, warps = layout or one_row_layout(out_features, in_features)
    out = torch.empty((1, out_features), dtype=x.dtype, device=x.device)
    _one_row_linear_kernel[(triton.cdiv(out_features, outputs),)](
        x, weight, out, out_features, in_features, BLOCK_N=outputs, BLOCK_K=step, num_warps=warps)
    return out
