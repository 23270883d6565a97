"""A prefill's attention in the fused text model (app.model.text.fused): each prompt's new tokens against its own
slot's keys and values in the store, up to each token's own column. Three layouts of a prefill's rows
(app.model.text.rows) and a function for each:

- packed: prompts back to back (a wave launched from Python), attending in padded groups of like lengths;
- padded: prompts front-padded to one length from a fresh state (a captured prefill), masked by rows.sees;
- continued: prompts padded at their end to one length, each going on after its slot's first `starts[i]`
  tokens (a captured continued prefill: a follow-up's new turn, a generation prompt). On CUDA one Triton kernel
  reads each slot's columns in place, as many as each row needs (app.model.text.prefill_kernels); the
  PyTorch version gathers every slot's first columns (as many as rows.sees has) and masks them.

Queries [rows, heads, head_dim] as app.model.text.ops.attention_inputs gives them; outputs [rows, heads *
head_dim], before the output gate.
"""

import torch
import torch.nn.functional as F

from app.model.text import ops as text_ops
from app.model.text.rows import ContinuedRows, PackedAttention, Rows


def packed(query, keys, values, attention: PackedAttention, heads: int, kv_heads: int, head_dim: int,
           scale: float) -> torch.Tensor:
    """Each prompt's attention over the keys and values of its slot up to each of its tokens (its tokens
    packed back to back in `query`, after what its slot held before): a group of prompts of like
    lengths in one padded call (app.model.text.rows.PackedAttention), a prompt alone by itself."""
    group = heads // kv_heads
    attended = query.new_empty((query.shape[0], heads * head_dim))
    for batch in attention.groups:
        prompts, length, columns = batch.slots.shape[0], batch.length, batch.columns
        own_keys, own_values = (t[:, :, :columns].index_select(0, batch.slots) for t in (keys, values))
        queries = query.index_select(0, batch.gather).view(prompts, length, kv_heads, group, head_dim)
        queries = queries.permute(0, 2, 3, 1, 4).reshape(prompts, kv_heads, group * length, head_dim)
        sees = batch.sees[:, None, None].expand(prompts, 1, group, length, columns)
        out = F.scaled_dot_product_attention(queries, own_keys, own_values, scale=scale,
                                             attn_mask=sees.reshape(prompts, 1, group * length, columns))
        out = out.view(prompts, kv_heads, group, length, head_dim).permute(0, 3, 1, 2, 4)
        attended.index_copy_(0, batch.rows, out.reshape(prompts * length, -1).index_select(0, batch.places))
    for slot, start, length, at in attention.alone:
        end = start + length
        own = query[at:at + length].transpose(0, 1)[None]
        if start:
            sees = torch.arange(end, device=query.device)[None, :] <= torch.arange(start, end, device=query.device)[:, None]
            masking = {"attn_mask": sees}
        else:
            masking = {"is_causal": True}
        out = F.scaled_dot_product_attention(
            own, keys[slot, :, :end].repeat_interleave(group, dim=0)[None],
            values[slot, :, :end].repeat_interleave(group, dim=0)[None], scale=scale, **masking)
        attended[at:at + length] = out[0].transpose(0, 1).reshape(length, -1)
    return attended


def padded(query, keys, values, rows: Rows | ContinuedRows, heads: int, kv_heads: int, head_dim: int,
           scale: float) -> torch.Tensor:
    """Each padded row's attention over its slot's first columns (as many as rows.sees has), masked by
    rows.sees. The query heads sharing a key head attend as that head's rows: each slot's keys are
    gathered once, not once per query head."""
    group = heads // kv_heads
    sequences, length, columns = rows.sequences, rows.lengths[0], rows.sees.shape[2]
    own_keys, own_values = (t[:, :, :columns].index_select(0, rows.prompt_slots) for t in (keys, values))
    queries = query.view(sequences, length, kv_heads, group, head_dim).permute(0, 2, 3, 1, 4)
    sees = rows.sees[:, None, None].expand(sequences, 1, group, length, columns)
    attended = F.scaled_dot_product_attention(
        queries.reshape(sequences, kv_heads, group * length, head_dim), own_keys, own_values,
        attn_mask=sees.reshape(sequences, 1, group * length, columns), scale=scale)
    attended = attended.view(sequences, kv_heads, group, length, head_dim).permute(0, 3, 1, 2, 4)
    return attended.reshape(sequences * length, -1)


def continued(query, keys, values, rows: ContinuedRows, heads: int, kv_heads: int, head_dim: int,
              scale: float) -> torch.Tensor:
    """padded's attention for a continued prefill's rows (ContinuedRows.padded). The kernel gives zeros for the
    places of a program's block that are all padding (their outputs are never read; docs/DECISIONS.md D61)."""
    if query.is_cuda and text_ops.triton_kernels(query.device) is not None:
        from app.model.text import prefill_kernels

        return prefill_kernels.continued_attention(query, keys, values, rows.prompt_slots, rows.prompt_starts,
                                                   rows.prompt_lengths, scale)
    return padded(query, keys, values, rows, heads, kv_heads, head_dim, scale)
