"""The operations of the fused text model (app.model.text.fused): its decode step, one token per
sequence, and its prefill of prompts packed back to back.

Each is one Triton kernel on CUDA (app.model.text.kernels) and plain PyTorch elsewhere. The PyTorch
versions below are the reference: they follow transformers' Qwen3.5 text layers operation for
operation (the CPU path gives the same logits as transformers' layers); the kernels compute the same in
fp32 registers and round once at the end, so on the GPU they differ from transformers by bf16 rounding.

Shapes: n rows (a sequence's token in a decode step, a prompt's token in a prefill); `projection` is
a row of a merged input projection, read at column offsets.
"""

import functools
import logging

import torch
import torch.nn.functional as F

from app import tuning

log = logging.getLogger(__name__)


@functools.cache
def triton_kernels(device: torch.device):
    """The Triton kernels, or None where they cannot run on `device`: the PyTorch versions run then,
    slower (the fused vision tower's kernels too: app.model.vision.ops). Triton compiles a small
    launcher with the machine's C compiler on first use, so a box without one (or a GPU Triton does not
    support) fails there: one tiny kernel is tried first. The attention kernels' 16-bit matrix products
    need an Ampere GPU or newer (compute capability 8.0; they were measured on an H200)."""
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 0):
        log.warning("The fused models' Triton kernels need a GPU of compute capability 8.0 or newer; "
                    "they run in PyTorch on this one")
        return None
    try:
        from app.model.text import kernels as text_kernels

        text_kernels.add_rms_norm(torch.ones((1, 8), device=device), None, torch.ones(8, device=device), 1e-6)
    except Exception as error:
        log.warning("The fused text model's Triton kernels cannot run here (%s); it runs them in PyTorch", error)
        return None
    return text_kernels


def _kernels_for(tensor: torch.Tensor):
    return triton_kernels(tensor.device) if tensor.is_cuda else None


def _rms_normalized(hidden: torch.Tensor, eps: float) -> torch.Tensor:
    """`hidden` (fp32) over the root mean square of its last dimension."""
    return hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + eps)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float):
    """(RMS-normalized residual + x times `weight`, the new residual): the residual stream is kept in
    x's dtype, as the model adds it. `weight` is fp32 and already the model's 1 + w."""
    kernels = _kernels_for(x)
    if kernels is not None:
        return kernels.add_rms_norm(x, residual, weight, eps)
    if residual is not None:
        x = residual + x
    return (_rms_normalized(x.float(), eps) * weight).to(x.dtype), x


def conv_step(projection: torch.Tensor, channels: int, state: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The DeltaNet layer's causal depthwise convolution for one new input (the first `channels` columns
    of `projection`), then SiLU. `state` [n, channels, width] holds the last inputs and is shifted in
    place; `weight` [channels, width]. Returns [n, channels]."""
    kernels = _kernels_for(projection)
    if kernels is not None:
        return kernels.conv_step(projection, channels, state, weight)
    window = torch.cat([state[:, :, 1:], projection[:, :channels, None]], dim=-1).to(weight.dtype)
    state.copy_(window)
    return F.silu(F.conv1d(window, weight[:, None], groups=channels)[:, :, 0])


def packed_conv(projection: torch.Tensor, channels: int, weight: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """The DeltaNet layer's causal depthwise convolution, then SiLU, over prompts laid out one after
    another, each from a zero state: the first `channels` columns of `projection`, `weight` [channels,
    width]. `positions` [tokens]: how many rows before each belong to its prompt (its place in it).
    Returns [tokens, channels]."""
    kernels = _kernels_for(projection)
    if kernels is not None:
        return kernels.packed_conv(projection, channels, weight, positions)
    inputs = projection[:, :channels].to(weight.dtype)
    width = weight.shape[1]
    convolved = inputs * weight[:, width - 1]
    for back in range(1, width):  # the input `back` rows before, where it is of the same prompt
        earlier = F.pad(inputs, (0, 0, back, 0))[:len(inputs)] * (positions >= back)[:, None]
        convolved = convolved + earlier * weight[:, width - 1 - back]
    return F.silu(convolved).to(projection.dtype)


def chunk_delta_rule(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, decay: torch.Tensor,
                     beta: torch.Tensor, bounds: torch.Tensor | None = None, device_bounds: torch.Tensor | None = None,
                     initial_state: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule as the DeltaNet layer's prefill runs it, each prompt from a zero state (or from
    its row of `initial_state` [prompts, value_heads, K, V], fp32: a prompt that goes on from a conversation's
    kept state): prompts of one length as a batch, or, given `bounds`, prompts packed back to back in one row
    (`bounds`: where each starts, then the end, on the CPU; `device_bounds` the same on the inputs'
    device). Queries and keys [rows, tokens, key_heads, K] are L2-normalized inside; values [rows,
    tokens, value_heads, V], decays (log space, fp32) and betas [rows, tokens, value_heads]. Returns
    the outputs [rows, tokens, value_heads, V] and each prompt's final state [prompts, value_heads, K,
    V] (fp32).

    flash-linear-attention's chunked kernels on CUDA (the ones transformers' layer calls, given the
    packing); transformers' PyTorch version prompt by prompt elsewhere."""
    if _kernels_for(query) is not None and _flash_linear_attention() is not None:  # it needs Triton too
        return _flash_linear_attention()(
            query, key, value, g=decay, beta=beta, initial_state=initial_state, output_final_state=True,
            use_qk_l2norm_in_kernel=True, cu_seqlens=device_bounds, cu_seqlens_cpu=bounds)
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule

    if bounds is None:
        return torch_chunk_gated_delta_rule(query, key, value, g=decay, beta=beta, initial_state=initial_state,
                                            output_final_state=True, use_qk_l2norm_in_kernel=True)
    outputs, states = [], []
    starts = bounds.tolist()
    for index, (start, end) in enumerate(zip(starts, starts[1:])):
        prompt = slice(start, end)
        out, state = torch_chunk_gated_delta_rule(
            query[:, prompt], key[:, prompt], value[:, prompt], g=decay[:, prompt], beta=beta[:, prompt],
            initial_state=None if initial_state is None else initial_state[index:index + 1],
            output_final_state=True, use_qk_l2norm_in_kernel=True)
        outputs.append(out)
        states.append(state)
    return torch.cat(outputs, dim=1), torch.cat(states)


@functools.cache
def _flash_linear_attention():
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except ImportError:
        return None
    return chunk_gated_delta_rule


def continued_conv(projection: torch.Tensor, channels: int, state: torch.Tensor, slots: torch.Tensor,
                   lengths: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """packed_conv for prompts padded at their end to one length (a captured continued prefill's rows:
    app.model.text.rows.ContinuedRows.padded), each going on from the inputs its slot's convolution state holds:
    prompt i's rows are the i-th `length` of `projection`, its first `lengths[i]` real. `state` [slots, channels,
    width] is the whole store's; slot `slots[i]`'s moves on past prompt i's real inputs, in place. Returns [rows,
    channels]; a padding row's output is never read."""
    if _kernels_for(projection) is not None:
        from app.model.text import prefill_kernels

        return prefill_kernels.continued_conv(projection, channels, state, slots, lengths, weight)
    prompts, width = slots.shape[0], weight.shape[1]
    length = projection.shape[0] // prompts
    kept = state.index_select(0, slots).transpose(1, 2).to(projection.dtype)  # [prompts, width, channels]
    inputs = torch.cat([kept, projection[:, :channels].reshape(prompts, length, channels)], dim=1)
    # Each prompt's kept inputs, then its new ones, as one packed prompt.
    places = torch.arange(width + length, device=projection.device).repeat(prompts)
    convolved = packed_conv(inputs.reshape(-1, channels), channels, weight, places).view(prompts, width + length, channels)
    last = (lengths[:, None] + torch.arange(width, device=lengths.device))[..., None].expand(-1, -1, channels)
    state.index_copy_(0, slots, inputs.gather(1, last).transpose(1, 2).to(state.dtype))
    return convolved[:, width:].reshape(prompts * length, channels)


def continued_delta_steps(qkv: torch.Tensor, projection: torch.Tensor, beta_column: int, decay_column: int,
                          a_log: torch.Tensor, dt_bias: torch.Tensor, state: torch.Tensor, slots: torch.Tensor,
                          lengths: torch.Tensor, key_heads: int) -> torch.Tensor:
    """gated_delta_step at each place in turn, for prompts laid out as continued_conv's, each from its slot's
    recurrent state in `state` [slots, value_heads, K, V] (fp32, the whole store's), which moves on past the
    prompt's real tokens in place. For a few tokens a prompt (a generation prompt) in place of chunk_delta_rule,
    whose kernels are many small launches there (docs/DECISIONS.md D67). Returns [rows, value_heads * V]; a
    padding row's output is never read."""
    if _kernels_for(qkv) is not None:
        from app.model.text import prefill_kernels

        return prefill_kernels.continued_delta_steps(qkv, projection, beta_column, decay_column, a_log, dt_bias, state,
                                                     slots, lengths, key_heads)
    prompts = slots.shape[0]
    length = qkv.shape[0] // prompts
    held = state.index_select(0, slots)
    places = torch.arange(prompts, device=qkv.device) * length
    outputs = [gated_delta_step(qkv[places + place], projection[places + place], beta_column, decay_column, a_log,
                                dt_bias, held, key_heads, (place < lengths).long()) for place in range(length)]
    state.index_copy_(0, slots, held)
    return torch.stack(outputs, dim=1).reshape(prompts * length, -1)


def delta_gates(projection: torch.Tensor, beta_column: int, decay_column: int, value_heads: int,
                a_log: torch.Tensor, dt_bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule's betas (in the projection's dtype) and decays (log space, fp32) [rows,
    value_heads] from their raw inputs, `projection` columns from beta_column and decay_column."""
    beta = projection[:, beta_column:beta_column + value_heads].sigmoid()
    decay = -a_log.float().exp() * F.softplus(projection[:, decay_column:decay_column + value_heads].float() + dt_bias)
    return beta, decay


def gated_delta_step(qkv: torch.Tensor, projection: torch.Tensor, beta_column: int, decay_column: int,
                     a_log: torch.Tensor, dt_bias: torch.Tensor, state: torch.Tensor, key_heads: int,
                     columns: torch.Tensor) -> torch.Tensor:
    """One token of the gated delta rule. `qkv` [n, 2 * key_heads * K + value_heads * V] (queries, keys,
    values); the betas' and decays' raw inputs are `projection` columns from beta_column and
    decay_column, one per value head. `state` [n, value_heads, K, V] fp32 is updated in place, except
    for rows whose token's column (`columns` [n]) is 0: a captured step's padding (app.model.cuda_graphs),
    which reads and writes no state (docs/DECISIONS.md D60). Returns the output [n, value_heads * V]."""
    kernels = _kernels_for(qkv)
    if kernels is not None:
        return kernels.gated_delta_step(qkv, projection, beta_column, decay_column, a_log, dt_bias, state, key_heads,
                                        columns)
    n, value_heads, k_dim, v_dim = state.shape
    query, key, value = qkv.split([key_heads * k_dim, key_heads * k_dim, value_heads * v_dim], dim=-1)
    query, key = (t.reshape(n, key_heads, k_dim).repeat_interleave(value_heads // key_heads, dim=1).float()
                  for t in (query, key))
    query = query * torch.rsqrt((query * query).sum(-1, keepdim=True) + 1e-6) / k_dim ** 0.5
    key = key * torch.rsqrt((key * key).sum(-1, keepdim=True) + 1e-6)
    beta, decay = delta_gates(projection, beta_column, decay_column, value_heads, a_log, dt_bias)
    beta = beta.float()
    live = columns > 0
    updated = state * (decay.exp() * live[:, None])[..., None, None]  # a padding row's from a zero state
    remembered = (updated * key[..., None]).sum(dim=-2)
    delta = (value.reshape(n, value_heads, v_dim).float() - remembered) * beta[..., None]
    updated = updated + key[..., None] * delta[..., None, :]
    torch.where(live[:, None, None, None], updated, state, out=state)
    return (updated * query[..., None]).sum(dim=-2).to(qkv.dtype).reshape(n, -1)


def gated_rms_norm(x: torch.Tensor, projection: torch.Tensor, gate_column: int, weight: torch.Tensor,
                   eps: float) -> torch.Tensor:
    """Per head: RMS-normalized x times `weight`, times SiLU of the gate (`projection` columns from
    gate_column, as wide as x). x [n, heads * head_dim]; weight [head_dim]."""
    kernels = _kernels_for(x)
    if kernels is not None:
        return kernels.gated_rms_norm(x, projection, gate_column, weight, eps)
    n, width = x.shape
    heads = x.reshape(n, -1, weight.shape[0]).float()
    normed = _rms_normalized(heads, eps).to(x.dtype) * weight
    gate = projection[:, gate_column:gate_column + width].reshape(heads.shape).float()
    return (normed * F.silu(gate)).to(x.dtype).reshape(n, width)


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [n, in] @ weight [out, in].T: for one row on CUDA the one-row kernel (tuning.ONE_ROW_LINEAR), otherwise
    PyTorch's (cuBLAS)."""
    kernels = _kernels_for(x)
    if kernels is not None and tuning.ONE_ROW_LINEAR and x.dim() == 2 and x.shape[0] == 1 and x.is_contiguous() and weight.is_contiguous():
        return kernels.linear(x, weight)
    return F.linear(x, weight)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SiLU of the first half of each row times its second half: the MLP's [n, 2 * I] -> [n, I]."""
    kernels = _kernels_for(gate_up)
    if kernels is not None:
        return kernels.silu_and_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def attention_inputs(projection: torch.Tensor, heads: int, kv_heads: int, head_dim: int, q_norm: torch.Tensor,
                     k_norm: torch.Tensor, eps: float, inv_freq: torch.Tensor, rope_scaling: float,
                     rope_positions: torch.Tensor, slots: torch.Tensor, columns: torch.Tensor, keys: torch.Tensor,
                     values: torch.Tensor) -> torch.Tensor:
    """The full-attention layer's queries [n, heads, head_dim], ready: RMS-normalized per head (q_norm,
    k_norm fp32, the model's 1 + w), rotary embedding over the first 2 * len(inv_freq) dimensions at
    `rope_positions`. Row i's new key and value are written into `keys` / `values` [slots, kv_heads,
    columns, head_dim] at slot `slots[i]`, column `columns[i]`.

    `projection` [n, heads * 2 * head_dim + 2 * kv_heads * head_dim]: per head a query then its output
    gate (the model's q_proj layout), then keys, then values."""
    kernels = _kernels_for(projection)
    if kernels is not None:
        return kernels.attention_inputs(projection, heads, kv_heads, head_dim, q_norm, k_norm, eps, inv_freq,
                                        rope_scaling, rope_positions, slots, columns, keys, values)
    n = projection.shape[0]
    query_gate, key, value = projection.split([heads * 2 * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    query = query_gate.reshape(n, heads, 2 * head_dim)[..., :head_dim]

    def normed(t, weight):
        return (_rms_normalized(t.float(), eps) * weight).to(t.dtype)

    freqs = rope_positions[:, None].float() * inv_freq
    cos = (torch.cat([freqs, freqs], dim=-1).cos() * rope_scaling).to(projection.dtype)[:, None]
    sin = (torch.cat([freqs, freqs], dim=-1).sin() * rope_scaling).to(projection.dtype)[:, None]

    def rotated(t):
        rotary = cos.shape[-1]
        part, rest = t[..., :rotary], t[..., rotary:]
        first, second = part.chunk(2, dim=-1)
        return torch.cat([part * cos + torch.cat([-second, first], dim=-1) * sin, rest], dim=-1)

    query = rotated(normed(query, q_norm))
    keys[slots, :, columns] = rotated(normed(key.reshape(n, kv_heads, head_dim), k_norm))
    values[slots, :, columns] = value.reshape(n, kv_heads, head_dim)
    return query


def attend(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor, scale: float,
           projection: torch.Tensor) -> torch.Tensor:
    """Attention of each sequence's queries [n, heads, head_dim] over its columns [0, positions[i]] of
    `keys` / `values` [slots, kv_heads, columns, head_dim], times the sigmoid of each head's output gate
    (in `projection`, after the head's query: see attention_inputs). Returns [n, heads * head_dim]."""
    kernels = _kernels_for(query)
    if kernels is not None:
        return kernels.attend(query, keys, values, positions, scale, projection)
    n, heads, head_dim = query.shape
    kv_heads = keys.shape[1]
    visible = torch.arange(keys.shape[2], device=query.device)[None, :] <= positions[:, None]
    # The query heads sharing a key head attend as that head's rows: keys are read once per key head.
    grouped = query.view(n, kv_heads, heads // kv_heads, head_dim)
    attended = F.scaled_dot_product_attention(grouped, keys[:n], values[:n], attn_mask=visible[:, None, None, :],
                                              scale=scale).reshape(n, heads * head_dim)
    return output_gated(attended, projection, heads, head_dim)


def output_gated(attended: torch.Tensor, projection: torch.Tensor, heads: int, head_dim: int) -> torch.Tensor:
    """Attention output [rows, heads * head_dim] times the sigmoid of each head's output gate (in
    `projection`, after the head's query: see attention_inputs). In PyTorch everywhere: on CUDA the
    decode step's attend does it inside its kernel."""
    rows = attended.shape[0]
    gate = projection[:, :heads * 2 * head_dim].reshape(rows, heads, 2 * head_dim)[..., head_dim:]
    return attended * torch.sigmoid(gate.reshape(rows, heads * head_dim))
