"""The checkpoint's processor as the app loads it: transformers' own, with MiniCPM-V 4.6's image and video
processors (4.7 uses them too) cutting patches by a reshape, and leaving pixels in uint8 for the engine to normalize
on its device (`normalized_pixels`). app.engine.inputs runs it on a conversation."""

import functools


def load_processor(path: str, trust_remote_code: bool):
    """The checkpoint's processor (tokenizer, chat template, image and video processors), patches cut
    fast, images and videos left unnormalized."""
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(path, trust_remote_code=trust_remote_code)
    _cut_patches_by_reshape(processor)
    _leave_images_unnormalized(processor)
    _leave_videos_unnormalized(processor)
    return processor


def _leave_images_unnormalized(processor) -> None:
    """Images come out of the app's processor as the uint8 pixels of their resized slices, their
    tensors holding the normalization the model expects (`pixel_normalization`: mean and std on the
    0-255 scale), and the engine normalizes them on its device (app.model.runner). On a CPU
    core, normalizing float32 pixels, cutting and joining them and casting them to bf16 took two
    thirds of the processor's time for a 1344x1344 image; uint8 pixels are also half of bf16's bytes
    on their way to the engine and the GPU. For MiniCPM-V 4.6's image processor (4.7 uses it too)
    when it rescales and normalizes, as its checkpoints do."""
    image_processor = getattr(processor, "image_processor", None)
    normalization = _normalization_turned_off(image_processor, image_patches, "image")
    if normalization is None:
        return
    processor.pixel_normalization = normalization
    image_processor._preprocess = functools.partial(_uint8_slices, image_processor)


def _uint8_slices(image_processor, images: list, do_resize: bool, resample, do_rescale: bool, rescale_factor: float,
                  do_normalize: bool, image_mean, image_std, max_slice_nums: int, scale_resolution: int,
                  patch_size: int, slice_mode: bool, downsample_mode: str, return_tensors=None, **kwargs):
    """MiniCPMV4_6ImageProcessor._preprocess for _leave_images_unnormalized: the same source view and
    slices, cut into patches the same way, left in uint8. The method as shipped turns every slice into
    float32 before rescaling and normalizing, which are off here; without that conversion and the one
    back, preparing a 1344x1344 PNG took 46.5 ms on a core of an H200 box (62.2 before, on another box of
    the same kind; docs/DECISIONS.md D11)."""
    import torch
    from transformers.image_processing_utils import BatchFeature
    from transformers.image_transforms import divide_to_patches
    from transformers.image_utils import SizeDict

    pixel_values, target_sizes, grids, counts = [], [], [], []
    for image in images:
        size = image.shape[-2:]
        grid = image_processor.get_sliced_grid(size, max_slice_nums, scale_resolution) if slice_mode else None
        source_height, source_width = image_processor.find_best_resize(
            size, scale_resolution, patch_size, downsample_mode=downsample_mode, allow_upscale=grid is None)
        views = [image_processor.resize(image, size=SizeDict(height=source_height, width=source_width), resample=resample)]
        sizes = [[source_height // patch_size, source_width // patch_size]]
        if grid is not None:
            refine_height, refine_width = image_processor.get_refine_size(
                size, grid, scale_resolution, patch_size, downsample_mode=downsample_mode, allow_upscale=True)
            refined = image_processor.resize(image, size=SizeDict(height=refine_height, width=refine_width), resample=resample)
            slice_height, slice_width = refined.shape[-2] // grid[0], refined.shape[-1] // grid[1]
            slices = divide_to_patches(refined, (slice_height, slice_width))
            views += slices
            sizes += [[slice_height // patch_size, slice_width // patch_size]] * len(slices)
        pixel_values += [image_patches(view.to(torch.uint8), patch_size) for view in views]
        target_sizes += sizes
        grids.append(grid if grid is not None else [0, 0])
        counts.append(len(views))
    return BatchFeature(
        data={"pixel_values": torch.cat(pixel_values, dim=-1).unsqueeze(0),
              "target_sizes": torch.tensor(target_sizes, dtype=torch.int32), "grids": grids,
              "num_patches_per_image": counts},
        tensor_type=return_tensors, skip_tensor_conversion=["grids", "num_patches_per_image"])


def _cut_patches_by_reshape(processor) -> None:
    """MiniCPM-V 4.6's torch image and video processors (4.7 uses them too) cut every slice into 14x14
    patches with unfold (im2col): 1.4 ms for a 448x448 slice on a CPU core, 12 of the 88 ms it takes to
    prepare a 1344x1344 image. The same layout is a view and one copy (0.2 ms), as transformers' own PIL
    image processor makes it. Only processors that use those classes' own method are changed."""
    shipped = _shipped_processors()
    if shipped is None:  # a transformers without 4.6: nothing of theirs to change
        return
    for name, known, cut in (("image_processor", shipped["image"], image_patches),
                             ("video_processor", shipped["video"], _video_patches)):
        part = getattr(processor, name, None)
        if part is not None and getattr(type(part), "reshape_by_patch", None) is known.reshape_by_patch:
            part.reshape_by_patch = cut


def image_patches(image, patch_size: int):
    """[C, H, W] -> [C, patch_size, H * W / patch_size]: patch after patch, row by row, each patch's rows side by side."""
    channels, height, width = image.shape
    patches = image.reshape(channels, height // patch_size, patch_size, width // patch_size, patch_size)
    return patches.permute(0, 2, 1, 3, 4).reshape(channels, patch_size, -1)


def normalized_pixels(pixels, normalization):
    """uint8 pixels [..., channels, patch, width] from the app's processor, normalized by `normalization`
    (their tensors' pixel_normalization, on the pixels' device) as the processor as shipped does it,
    in float32."""
    mean, std = normalization.view(2, -1, 1, 1)
    return pixels.float().sub_(mean).div_(std)


def _video_patches(videos, patch_size: int):
    """[B, T, C, H, W] -> [B, T, C, patch_size, H * W / patch_size], each frame as image_patches cuts an image."""
    batch, frames, channels, height, width = videos.shape
    patches = videos.reshape(batch, frames, channels, height // patch_size, patch_size, width // patch_size, patch_size)
    return patches.permute(0, 1, 2, 4, 3, 5, 6).reshape(batch, frames, channels, patch_size, -1)


def _leave_videos_unnormalized(processor) -> None:
    """A video's frames come out of the app's processor as uint8 pixels, as images do
    (_leave_images_unnormalized), their tensors holding `video_pixel_normalization`. The video processor as
    shipped resizes in uint8 and only then rescales and normalizes in float32, so turning those two off is all it
    takes, and the engine's normalization gives its pixels bit for bit. They took about half of a 16-frame video's
    preparation on a CPU core, and float32 then bf16 pixels are twice uint8's bytes on their way to the engine
    (docs/DECISIONS.md D68). For MiniCPM-V 4.6's video processor when it resizes, rescales and normalizes, as its
    checkpoints do."""
    normalization = _normalization_turned_off(getattr(processor, "video_processor", None), _video_patches, "video")
    if normalization is not None:
        processor.video_pixel_normalization = normalization


def _normalization_turned_off(part, cut, kind: str):
    """For the app's image or video processor (`kind`) of MiniCPM-V 4.6 (its patches cut by `cut`, its own
    _preprocess) that resizes, rescales and normalizes: its rescaling and normalizing turned off, and what they
    did, mean and std on the 0-255 scale (fused as transformers' torch processors fuse them, in float32). Else
    None, the processor left as it is."""
    import torch

    if getattr(part, "reshape_by_patch", None) is not cut:
        return None
    if type(part)._preprocess is not _shipped_processors()[kind]._preprocess:
        return None
    if not (part.do_rescale and part.do_normalize and part.do_resize):
        return None
    factor = 1.0 / part.rescale_factor
    normalization = torch.stack([torch.tensor(part.image_mean) * factor, torch.tensor(part.image_std) * factor])
    part.do_rescale = part.do_normalize = False
    return normalization


def _shipped_processors() -> dict | None:
    """transformers' MiniCPM-V 4.6 image and video processor classes, by kind; None if it has none."""
    try:
        from transformers.models.minicpmv4_6.image_processing_minicpmv4_6 import MiniCPMV4_6ImageProcessor
        from transformers.models.minicpmv4_6.video_processing_minicpmv4_6 import MiniCPMV4_6VideoProcessor
    except ImportError:
        return None
    return {"image": MiniCPMV4_6ImageProcessor, "video": MiniCPMV4_6VideoProcessor}
