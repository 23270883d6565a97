"""Vision attention with one SDPA call per run of equal-size slices, instead of one per slice.

MiniCPM-V packs every slice of every image into one sequence. Without flash-attention, transformers
splits it and calls SDPA once per slice and layer: 270 calls for one 1344x1344 image, launch-bound on
a GPU. Slices of the same size lie side by side (an image's 3x3 grid, a wave of same-size photos, the
merger's equal windows), so each run of equal lengths becomes one batched call. Registered under a
name containing "flash" because that is what routes the model's packed (cu_seqlens) inputs to it.
"""

import torch
from torch.nn.functional import scaled_dot_product_attention

NAME = "grouped_sdpa_flash_varlen"


def grouped_varlen_attention(module, query, key, value, attention_mask=None, scaling=None, dropout=0.0,
                             cu_seq_lens_q=None, **kwargs):
    """query/key/value [1, heads, tokens, dim] holding back-to-back segments; returns [1, tokens, heads, dim]."""
    bounds = cu_seq_lens_q.tolist()
    lengths = [end - start for start, end in zip(bounds, bounds[1:])]
    heads, dim = query.shape[1], query.shape[3]
    outputs, start, index = [], 0, 0
    while index < len(lengths):
        length, count = lengths[index], 1
        while index + count < len(lengths) and lengths[index + count] == length:
            count += 1
        end = start + length * count

        def run(tensor):  # [1, heads, count*length, dim] -> [count, heads, length, dim]
            return tensor[0, :, start:end].reshape(heads, count, length, dim).transpose(0, 1)

        out = scaled_dot_product_attention(run(query), run(key), run(value), scale=scaling)
        outputs.append(out.permute(0, 2, 1, 3).reshape(count * length, heads, dim))
        start, index = end, index + count
    return torch.cat(outputs)[None], None


def use_grouped_vision_attention(model) -> None:
    """Route the vision tower's attention here unless a flash-attention kernel was asked for."""
    from transformers import AttentionInterface

    AttentionInterface.register(NAME, grouped_varlen_attention)
    vision_config = model.model.vision_tower.config
    if vision_config._attn_implementation in ("sdpa", "eager", None):
        vision_config._attn_implementation = NAME
