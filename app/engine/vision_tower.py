"""How the vision tower runs: one attention call per run of equal-size slices, on contiguous hidden states.

MiniCPM-V packs every slice of every image into one sequence. Without flash-attention, transformers
splits it and calls SDPA once per slice and layer: 270 calls for one 1344x1344 image, launch-bound on
a GPU. Slices of the same size lie side by side (an image's 3x3 grid, a wave of same-size photos, the
merger's equal windows), so each run of equal lengths becomes one batched call. Registered under a
name containing "flash" because that is what routes the model's packed (cu_seqlens) inputs to it.
"""

import torch
from torch.nn.functional import scaled_dot_product_attention

NAME = "grouped_sdpa_flash_varlen"
# A CUDA grid holds at most 65,535 blocks in its second and third dimensions, where SDPA's kernels put
# batch and heads: the merger's 2x2 windows of a 32-image wave (81,920 windows) failed with "invalid
# argument" on an H200. Longer runs are split into calls of at most this many rows times heads.
MAX_GRID_ROWS = 65535


def grouped_varlen_attention(module, query, key, value, attention_mask=None, scaling=None, dropout=0.0,
                             cu_seq_lens_q=None, **kwargs):
    """query/key/value [1, heads, tokens, dim] holding back-to-back segments; returns [1, tokens, heads, dim].

    The model hands over views of [1, tokens, heads, dim] projections, and SDPA's flash kernel writes
    [batch, length, heads, dim]: runs taken as views of that layout copy nothing, where reshaping the
    [1, heads, tokens, dim] views copied query, key, value and output in every layer.
    """
    bounds = cu_seq_lens_q.tolist()
    lengths = [end - start for start, end in zip(bounds, bounds[1:])]
    heads, dim = query.shape[1], query.shape[3]
    most = max(1, MAX_GRID_ROWS // heads)
    outputs, start, index = [], 0, 0
    while index < len(lengths):
        length, count = lengths[index], 1
        while index + count < len(lengths) and count < most and lengths[index + count] == length:
            count += 1
        end = start + length * count

        def run(tensor):  # [1, heads, tokens, dim] -> [count, heads, length, dim], a view when the layout allows
            return tensor.transpose(1, 2)[0, start:end].reshape(count, length, heads, dim).transpose(1, 2)

        out = scaled_dot_product_attention(run(query), run(key), run(value), scale=scaling)
        outputs.append(out.transpose(1, 2).reshape(count * length, heads, dim))
        start, index = end, index + count
    return (outputs[0] if len(outputs) == 1 else torch.cat(outputs))[None], None


def tune_vision_tower(model) -> None:
    """Route the vision tower's attention here unless a flash-attention kernel was asked for, and make
    its patch embeddings contiguous.

    The embeddings come out of the patch convolution as a transposed view; residual adds then mix two
    memory layouts and take PyTorch's slow strided path, and layer norms copy their input first. One
    copy at the start avoids that.
    """
    from transformers import AttentionInterface

    model.model.vision_tower.embeddings.register_forward_hook(lambda module, inputs, output: output.contiguous())
    AttentionInterface.register(NAME, grouped_varlen_attention)
    vision_config = model.model.vision_tower.config
    if vision_config._attn_implementation in ("sdpa", "eager", None):
        vision_config._attn_implementation = NAME
