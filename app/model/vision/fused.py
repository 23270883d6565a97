"""The vision tower written out with few kernels: MiniCPM-V 4.6/4.7's SigLIP encoder, the window merger
inside it and the final merger, over any number of images' slices (and video frames) packed back to back.

Through transformers' modules (app.model.vision.tower tunes them) the tower was 84% of a prefill
wave's GPU time on an H200 (docs/DECISIONS.md D22), and for one image a chain of small launches. Here:
- the patch convolution is one matrix product over patches cut by a view, with the conv's bias and
  the position embeddings (one table, added once at load) as the product's C input;
- a layer is seven kernels: residual add + layer norm (one kernel, twice), the q/k/v projections as one
  product (weights concatenated at load, the modules keeping views, so transformers' path still works
  and no memory is added), attention, the output projection, fc1 with its GELU as the product's
  epilogue, fc2;
- attention is one SDPA call per run of equal-size slices, on views of the merged projection (nothing
  is copied into heads-first order and back);
- the window merger's 2x2 windows are attended by one kernel (app.model.vision.ops.window_attention);
- where tokens go (position ids, window order, the final merger's order) is worked out on the CPU from
  a cache per slice size and sent to the GPU in one copy, which does not wait for the GPU.

Used for any checkpoint whose tower has plain linear layers (a quantized tower keeps transformers'
modules) and is otherwise what the code here assumes (fused_vision_tower_for checks);
`MINICPMV_FUSED_VISION_TOWER=0` asks for transformers' modules.
"""

import functools
import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from app.model.vision import ops as vision_ops
from app.model.text.fused import merge_parameters
from app.model.text.rows import in_one_copy
from app.model.vision.tower import (equal_runs, slice_merge_order, slice_position_ids, slice_starts,
                                     slice_window_order)

log = logging.getLogger(__name__)


def fused_vision_tower_for(model):
    """A FusedVisionTower for `model`, or None where it does not apply (the reason is logged)."""
    reason = _tower_mismatch(model.model.vision_tower)
    if reason:
        log.info("The vision tower runs through transformers' modules, not the fused one: %s", reason)
        return None
    return FusedVisionTower(model)


def _tower_mismatch(tower) -> str | None:
    """What of the tower the fused one would not compute as transformers' modules do. It reads the rest:
    sizes, heads, eps, the patch size, where the window merger goes, the final merger's kernel and rounds."""
    if tower.config.hidden_act != "gelu_pytorch_tanh":  # the encoder MLPs' (the window merger's is fixed)
        return f"hidden_act {tower.config.hidden_act}"
    if getattr(tower, "vit_merger", None) is None:
        return "no window merger"
    window = tuple(tower.vit_merger.window_kernel_size)
    if window[0] != window[1]:  # slice_window_order's windows are square
        return f"window kernel {window}"
    linears = [tower.vit_merger.linear_1, tower.vit_merger.linear_2]
    norms = [tower.post_layernorm, tower.vit_merger.layer_norm1, tower.vit_merger.pre_norm]
    for layer in [*tower.encoder.layers, tower.vit_merger]:
        attention = layer.self_attn
        linears += [attention.q_proj, attention.k_proj, attention.v_proj, attention.out_proj]
    for layer in tower.encoder.layers:
        linears += [layer.mlp.fc1, layer.mlp.fc2]
        norms += [layer.layer_norm1, layer.layer_norm2]
    if any(type(module) is not torch.nn.Linear or module.bias is None for module in linears):
        return "linear layers other than plain nn.Linear with a bias (a quantized checkpoint)"
    # On CUDA vision_ops.add_layer_norm's kernel takes a norm without a bias for an RMS norm.
    if any(type(norm) is not torch.nn.LayerNorm or norm.weight is None or norm.bias is None for norm in norms):
        return "a norm other than a layer norm with weight and bias"
    patch, size = tower.embeddings.patch_embedding, tower.embeddings.patch_size
    # The patch convolution as one matrix product over patches cut by a view.
    if type(patch) is not torch.nn.Conv2d or patch.bias is None or patch.kernel_size != (size, size) \
            or patch.stride != (size, size) or patch.padding not in ("valid", (0, 0)):
        return "a patch embedding other than a convolution of patch_size with stride patch_size and a bias"
    return None


def _norm(norm) -> tuple:
    return norm.weight, norm.bias, norm.eps


# cuDNN's attention runs the tower's 72-wide heads about 1.6x faster than flash's (which rounds them up
# to 96) on a big wave's slices, but takes more host time a call: it is asked for from this many slices.
CUDNN_FROM_SLICES = 16


def _attend_slices(qkv: torch.Tensor, runs: list[tuple[int, int]], heads: int, scale: float) -> torch.Tensor:
    """Attention within each slice, slices back to back in `qkv` [tokens, 3 * hidden]; `runs` lists
    (slice length, slices) of consecutive equal slices. Returns [tokens, hidden]."""
    hidden = qkv.shape[1] // 3
    outputs, start = [], 0
    for length, count in runs:
        rows = qkv[start:start + length * count].view(count, length, 3, heads, hidden // heads)
        query, key, value = (rows[:, :, part].transpose(1, 2) for part in range(3))
        attended = None
        if count >= CUDNN_FROM_SLICES and _cudnn_attention_runs(query):
            # cuDNN's kernel called by name: sdpa_kernel() would turn cuDNN on for the whole process while it
            # lasts, and the scheduler's thread (the tower is launched from another) keeps it off (D23, D63).
            try:
                attended = torch.ops.aten._scaled_dot_product_cudnn_attention(query, key, value, None, False,
                                                                               scale=scale)[0]
            except RuntimeError:  # a shape or build this cuDNN refuses: SDPA's own choice, as without it
                log.warning("cuDNN's attention refused %s slices of %s tokens", count, length, exc_info=True)
        if attended is None:
            attended = F.scaled_dot_product_attention(query, key, value, scale=scale)
        outputs.append(attended.transpose(1, 2).reshape(length * count, hidden))
        start += length * count
    return outputs[0] if len(outputs) == 1 else torch.cat(outputs)


def _cudnn_attention_runs(query: torch.Tensor) -> bool:
    """Whether cuDNN's attention kernel takes `query` [slices, heads, tokens, head dim], as PyTorch's SDPA would
    choose it: 16-bit, a head dimension of at most 128 in multiples of 8, on a GPU of compute capability 8.0 on
    with cuDNN 9."""
    head_dim = query.shape[-1]
    return (query.dtype in (torch.float16, torch.bfloat16) and head_dim % 8 == 0 and head_dim <= 128
            and _cudnn_attention_device(query.device))


@functools.cache
def _cudnn_attention_device(device: torch.device) -> bool:
    return (device.type == "cuda" and torch.backends.cudnn.is_available() and torch.backends.cudnn.version() >= 90000
            and torch.cuda.get_device_capability(device) >= (8, 0))


class _Attention:
    def __init__(self, attention):
        self.heads = attention.num_heads
        self.scale = attention.scaling
        linears = (attention.q_proj, attention.k_proj, attention.v_proj)
        self.qkv_weight = merge_parameters(*linears)
        self.qkv_bias = merge_parameters(*linears, name="bias")
        self.out_weight, self.out_bias = attention.out_proj.weight, attention.out_proj.bias

    def projected(self, normed):
        return F.linear(normed, self.qkv_weight, self.qkv_bias)

    def out(self, attended):
        return F.linear(attended, self.out_weight, self.out_bias)


class _EncoderLayer:
    def __init__(self, layer):
        self.attention = _Attention(layer.self_attn)
        self.norm1, self.norm2 = _norm(layer.layer_norm1), _norm(layer.layer_norm2)
        self.fc1, self.fc2 = layer.mlp.fc1, layer.mlp.fc2

    def __call__(self, hidden, residual, runs):
        """(this layer's output, the residual stream before it is added): the add is the next norm's."""
        normed, residual = vision_ops.add_layer_norm(hidden, residual, *self.norm1)
        attention = self.attention
        attended = _attend_slices(attention.projected(normed), runs, attention.heads, attention.scale)
        normed, residual = vision_ops.add_layer_norm(attention.out(attended), residual, *self.norm2)
        widened = vision_ops.linear_gelu_tanh(normed, self.fc1.weight, self.fc1.bias)
        return F.linear(widened, self.fc2.weight, self.fc2.bias), residual


class _WindowMerger:
    """The tower's window merger (MiniCPMV4_6ViTWindowAttentionMerger): attention within each 2x2 window,
    then each window's four tokens become one (an MLP over the four, plus their mean)."""

    def __init__(self, merger):
        self.window = merger.window_kernel_size[0] * merger.window_kernel_size[1]
        self.attention = _Attention(merger.self_attn)
        self.norm, self.pre_norm = _norm(merger.layer_norm1), _norm(merger.pre_norm)
        self.linear_1, self.linear_2 = merger.linear_1, merger.linear_2

    def __call__(self, hidden, residual, window_order):
        normed, summed = vision_ops.add_layer_norm(hidden, residual, *self.norm)
        normed, summed = normed[window_order], summed[window_order]
        attention = self.attention
        attended = vision_ops.window_attention(attention.projected(normed), attention.heads, self.window,
                                               attention.scale)
        windows = (summed + attention.out(attended)).view(-1, self.window, summed.shape[-1])
        weight, bias, eps = self.pre_norm
        flat = F.layer_norm(windows.flatten(1), (weight.shape[0],), weight, bias, eps)
        widened = vision_ops.linear_gelu_tanh(flat, self.linear_1.weight, self.linear_1.bias)
        return F.linear(widened, self.linear_2.weight, self.linear_2.bias) + windows.mean(dim=1)


@dataclass
class _Layout:
    """Where a wave's tokens go: slice lengths (as attention runs) before and after the window merger,
    features per slice, and on the device the position ids, the window order (None without the window
    merger) and the final merger's order per round."""

    runs: list
    merged_runs: list
    features: list[int]
    position_ids: torch.Tensor
    window_order: torch.Tensor | None
    merge_orders: list[torch.Tensor]


class FusedVisionTower:
    """features(pixels, target_sizes, downsample_mode): each slice's visual features, as
    model.model.get_image_features returns them (pooler_output); pixels [channels, patch, tokens *
    patch] (the processor's packing without its batch dimension) on the device, sizes [slices, 2] on the CPU."""

    def __init__(self, model):
        tower = model.model.vision_tower
        embeddings = tower.embeddings
        self.patch = embeddings.patch_size
        self.per_side = embeddings.num_patches_per_side
        self.patch_weight = embeddings.patch_embedding.weight.detach().flatten(1)  # [hidden, channels * patch^2]
        with torch.no_grad():
            self.position_table = embeddings.position_embedding.weight + embeddings.patch_embedding.bias
        self.layers = [_EncoderLayer(layer) for layer in tower.encoder.layers]
        self.heads = self.layers[0].attention.heads
        self.insert_after = tower.config.insert_layer_id
        self.window_merger = _WindowMerger(tower.vit_merger)
        self.window_size = tuple(tower.vit_merger.window_kernel_size)
        self.post_norm = _norm(tower.post_layernorm)
        self.merger = model.model.merger
        self.default_mode = model.config.downsample_mode

    @torch.no_grad()
    def features(self, pixels: torch.Tensor, target_sizes: torch.Tensor, downsample_mode: str | None) -> list[torch.Tensor]:
        merging = (downsample_mode or self.default_mode) != "4x" and self.insert_after >= 0
        layout = self._layout([tuple(size) for size in target_sizes.tolist()], merging, pixels.device)
        channels = pixels.shape[0]
        patches = pixels.to(self.patch_weight.dtype).view(channels, self.patch, -1, self.patch)
        patches = patches.permute(2, 0, 1, 3).reshape(-1, channels * self.patch * self.patch)
        hidden = torch.addmm(self.position_table[layout.position_ids], patches, self.patch_weight.t())
        residual, runs = None, layout.runs
        for index, layer in enumerate(self.layers):
            hidden, residual = layer(hidden, residual, runs)
            if merging and index == self.insert_after:
                hidden, residual, runs = self.window_merger(hidden, residual, layout.window_order), None, layout.merged_runs
        hidden, _ = vision_ops.add_layer_norm(hidden, residual, *self.post_norm)
        merge_h, merge_w = self.merger.merge_kernel_size
        for mlp, order in zip(self.merger.mlp, layout.merge_orders):
            hidden = mlp(hidden[order].view(-1, merge_h * merge_w * hidden.shape[-1]))
        return list(hidden.split(layout.features))

    def _layout(self, sizes: list[tuple[int, int]], merging: bool, device) -> _Layout:
        def divisible(sizes, kernel, what):
            if any(height % kernel[0] or width % kernel[1] for height, width in sizes):
                raise ValueError(f"Patch grids {sizes} must be divisible by {what} {kernel}")

        def starts(sizes):
            counts = torch.tensor([height * width for height, width in sizes])
            return slice_starts(counts, counts)

        parts = [torch.cat([slice_position_ids(size, self.per_side) for size in sizes])]
        runs = equal_runs([height * width for height, width in sizes], self.heads)
        merged_runs = runs
        if merging:
            divisible(sizes, self.window_size, "window kernel size")
            parts.append(torch.cat([slice_window_order(size, self.window_size[0])[0] for size in sizes]) + starts(sizes))
            sizes = [(height // self.window_size[0], width // self.window_size[1]) for height, width in sizes]
            merged_runs = equal_runs([height * width for height, width in sizes], self.heads)
        kernel = tuple(self.merger.merge_kernel_size)
        for _ in self.merger.mlp:
            divisible(sizes, kernel, "merge kernel size")
            parts.append(torch.cat([slice_merge_order(size, *kernel) for size in sizes]) + starts(sizes))
            sizes = [(height // kernel[0], width // kernel[1]) for height, width in sizes]
        on_device = in_one_copy(parts, device)
        position_ids = on_device.pop(0)
        window_order = on_device.pop(0) if merging else None
        return _Layout(runs, merged_runs, [height * width for height, width in sizes], position_ids, window_order,
                       on_device)
