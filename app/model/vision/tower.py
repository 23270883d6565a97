"""transformers' vision tower, tuned: one attention call per run of equal-size slices, and no work slice
by slice. Used where app.model.vision.fused does not apply (a quantized tower) or is turned off; the
slices' layout helpers here serve both.

MiniCPM-V packs every slice of every image into one sequence. Without flash-attention, transformers
splits it and calls SDPA once per slice and layer: 270 calls for one 1344x1344 image, launch-bound on
a GPU. Slices of the same size lie side by side (an image's 3x3 grid, a wave of same-size photos, the
merger's equal windows), so each run of equal lengths becomes one batched call. Registered under a
name containing "flash" because that is what routes the model's packed (cu_seqlens) inputs to it.

Around the layers, the model also works slice by slice: position ids and window order (small tensor
programs per slice, on every call) and the final merger (a loop of a dozen kernels and a few GPU syncs
per slice: 160 slices in a 16-image wave). `slice_layout` hands the tower the first two precomputed,
from a cache per slice size, and `merge_slices` merges every slice in one pass.
"""

import functools

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
    heads, dim = query.shape[1], query.shape[3]
    outputs, start = [], 0
    for length, count in equal_runs(_segment_lengths(cu_seq_lens_q), heads):
        end = start + length * count

        def run(tensor):  # [1, heads, tokens, dim] -> [count, heads, length, dim], a view when the layout allows
            return tensor.transpose(1, 2)[0, start:end].reshape(count, length, heads, dim).transpose(1, 2)

        out = scaled_dot_product_attention(run(query), run(key), run(value), scale=scaling)
        outputs.append(out.transpose(1, 2).reshape(count * length, heads, dim))
        start = end
    return (outputs[0] if len(outputs) == 1 else torch.cat(outputs))[None], None


def equal_runs(lengths: list[int], heads: int) -> list[tuple[int, int]]:
    """(length, count) of consecutive equal segment lengths: what one SDPA call takes as a batch, at
    most MAX_GRID_ROWS // heads segments."""
    most = max(1, MAX_GRID_ROWS // heads)
    runs = []
    for length in lengths:
        if runs and runs[-1][0] == length and runs[-1][1] < most:
            runs[-1] = (length, runs[-1][1] + 1)
        else:
            runs.append((length, 1))
    return runs


_last_bounds = (None, [])  # (cu_seqlens tensor, its segment lengths): every layer gets the same tensor


def _segment_lengths(cu_seqlens: torch.Tensor) -> list[int]:
    """Segment lengths of packed bounds, read from the GPU once per tensor rather than once per layer
    (each read waits for all queued work)."""
    global _last_bounds
    known, lengths = _last_bounds
    if known is not cu_seqlens:
        bounds = cu_seqlens.tolist()
        lengths = [end - start for start, end in zip(bounds, bounds[1:])]
        _last_bounds = (cu_seqlens, lengths)
    return lengths


class TransformersVisionTower:
    """The runner's vision backend through transformers' modules, tuned (see app.model.backends)."""

    def __init__(self, model):
        self.model = model
        tune_vision_tower(model)

    def features(self, pixels: torch.Tensor, sizes: torch.Tensor, mode: str) -> list[torch.Tensor]:
        """Each slice's visual features from slices packed back to back (app.model.vision.fused.FusedVisionTower.features)."""
        output = self.model.model.get_image_features(pixels[None], sizes, downsample_mode=mode,
                                                     **slice_layout(self.model, sizes))
        return list(output.pooler_output)


def tune_vision_tower(model) -> None:
    """Route the vision tower's attention here unless a flash-attention kernel was asked for, make its
    patch embeddings contiguous, and merge its slices in one pass.

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
    merger = model.model.merger
    merger.forward = functools.partial(merge_slices, merger)


def slice_layout(model, target_sizes: torch.Tensor) -> dict:
    """Keyword arguments for get_image_features / get_video_features: what the tower would otherwise
    work out slice by slice (transformers.vision_utils takes each precomputed under these names), for
    slices of `target_sizes` [slices, 2] (patches high, wide). Empty unless the tower's attention is
    ours: a flash-attention kernel would also receive these names and might read them."""
    tower = model.model.vision_tower
    if tower.config._attn_implementation != NAME:
        return {}
    sizes = [tuple(size) for size in target_sizes.tolist()]
    counts = torch.tensor([height * width for height, width in sizes])
    window = tower.vit_merger.window_kernel_size[0]
    orders, ends = zip(*(slice_window_order(size, window) for size in sizes))
    window_ends = torch.cat(ends) + slice_starts(counts, torch.tensor([len(end) for end in ends]))
    return {
        "position_ids": torch.cat([slice_position_ids(size, tower.embeddings.num_patches_per_side) for size in sizes]),
        "max_seqlen": int(counts.max()),
        "window_index": torch.cat(orders) + slice_starts(counts, counts),
        "cu_window_seqlens": torch.cat([torch.zeros(1, dtype=torch.int32), window_ends.int()]),
    }


def slice_starts(counts: torch.Tensor, repeats: torch.Tensor) -> torch.Tensor:
    """Where each slice's tokens start in the packed sequence (slices of `counts` tokens), slice i's
    start repeated `repeats[i]` times: what turns per-slice indices into packed ones."""
    return (counts.cumsum(0) - counts).repeat_interleave(repeats)


@functools.lru_cache(maxsize=256)
def slice_position_ids(size: tuple[int, int], per_side: int) -> torch.Tensor:
    from transformers.vision_utils import get_vision_nearest_position_ids

    return get_vision_nearest_position_ids(torch.tensor([size]), per_side)


@functools.lru_cache(maxsize=256)
def slice_window_order(size: tuple[int, int], window: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One slice's token order for the merger's window attention, and where its windows end."""
    from transformers.vision_utils import get_vision_window_index

    order, bounds = get_vision_window_index(torch.tensor([[1, *size]]), spatial_merge_size=1, window_size=window,
                                            patch_size=1)
    return order, bounds[1:].long()


def merge_slices(merger, hidden_states: torch.Tensor, target_sizes: torch.Tensor) -> list[torch.Tensor]:
    """The model's final merger (MiniCPMV4_6Merger.forward) over all slices at once: each round gathers
    every slice's 2x2 (merge kernel) neighbourhoods side by side, then runs its MLP once on them all.
    Features per slice, as the model's loop returns them."""
    merge_h, merge_w = merger.merge_kernel_size
    sizes = [tuple(size) for size in target_sizes.tolist()]
    hidden = hidden_states[0]
    for mlp in merger.mlp:
        if any(height % merge_h or width % merge_w for height, width in sizes):
            raise ValueError(f"Patch grids {sizes} must be divisible by merge kernel size {merger.merge_kernel_size}")
        counts = torch.tensor([height * width for height, width in sizes])
        order = torch.cat([slice_merge_order(size, merge_h, merge_w) for size in sizes]) + slice_starts(counts, counts)
        hidden = mlp(hidden[order.to(hidden.device)].reshape(-1, merge_h * merge_w * hidden.shape[-1]))
        sizes = [(height // merge_h, width // merge_w) for height, width in sizes]
    return list(hidden.split([height * width for height, width in sizes]))


@functools.lru_cache(maxsize=256)
def slice_merge_order(size: tuple[int, int], merge_h: int, merge_w: int) -> torch.Tensor:
    """One slice's tokens (row-major) reordered so that each merge neighbourhood is consecutive."""
    height, width = size
    grid = torch.arange(height * width).view(height // merge_h, merge_h, width // merge_w, merge_w)
    return grid.permute(0, 2, 1, 3).reshape(-1)
