"""JPEGs left for the engine to decode on its GPU: what a preparer hands over in place of their pixels, and
the processor's view of such a request (each image's slice sizes and grid, no pixels).

The prompt's ids depend on an image's size alone (app.media.budget plans the same cut from the header), so
a preparer renders the prompt as always and leaves decoding, resizing and slicing to the engine, which
makes the same uint8 slices on its GPU (app.model.jpegs) when it stages the request's pixels. No torch at
import, as everywhere in app.engine. docs/DECISIONS.md D43.
"""

from dataclasses import dataclass

from app.media.budget import ImageSlicing

# The key of a prepared request's tensors that holds its DeferredJpegs in place of "pixel_values".
DEFERRED_JPEGS = "jpegs_for_the_device"


@dataclass(frozen=True)
class DeferredJpegs:
    """A request's images, every one a JPEG the engine decodes itself (app.media.images.jpeg_for_the_device),
    in prompt order, with how the processor cuts each (its source view and slices)."""

    paths: tuple[str, ...]
    slicings: tuple[ImageSlicing, ...]
    patch_size: int

    @property
    def pixel_bytes(self) -> int:
        """The bytes of their uint8 slices, as the processor would have made them."""
        return 3 * sum(_view_pixels(slicing) for slicing in self.slicings)


def _view_pixels(slicing: ImageSlicing) -> int:
    pixels = slicing.source[0] * slicing.source[1]
    if slicing.grid:
        pixels += slicing.slice_count * slicing.slice_size[0] * slicing.slice_size[1]
    return pixels


def defers_jpegs(processor) -> bool:
    """Whether the engine can make this processor's pixels from a JPEG: MiniCPM-V 4.6's image processor
    leaving uint8 slices (app.engine.inputs._leave_images_unnormalized), resized bicubic, which is the
    resampling app.model.jpegs mirrors."""
    from transformers.image_utils import PILImageResampling

    resample = getattr(processor.image_processor, "resample", None)
    return getattr(processor, "pixel_normalization", None) is not None and resample == PILImageResampling.BICUBIC


def stand_in_images(count: int) -> list:
    """What the processor is handed for `count` images whose pixels the engine makes: it only counts them."""
    import torch

    return [torch.zeros((3, 1, 1), dtype=torch.uint8) for _ in range(count)]


class PlannedSlices:
    """The image processor, as the processor calls it, for a request whose pixels the engine makes: each
    image's view sizes (in patches), grid and view count from the slice plan, as the app's processor
    returns them (app.engine.inputs._uint8_slices), and no pixels. Everything else is the image
    processor's own."""

    def __init__(self, image_processor, slicings: tuple[ImageSlicing, ...]):
        self._image_processor = image_processor
        self._slicings = slicings

    def __getattr__(self, name):
        return getattr(self._image_processor, name)

    def __call__(self, images, return_tensors=None, **kwargs):
        import torch
        from transformers.image_processing_utils import BatchFeature

        patch = self._image_processor.patch_size
        target_sizes, grids, counts = [], [], []
        for slicing in self._slicings:
            target_sizes.append([slicing.source[0] // patch, slicing.source[1] // patch])
            if slicing.grid:
                target_sizes += [[slicing.slice_size[0] // patch, slicing.slice_size[1] // patch]] * slicing.slice_count
            grids.append(list(slicing.grid) if slicing.grid else [0, 0])
            counts.append(1 + slicing.slice_count)
        return BatchFeature(
            data={"target_sizes": torch.tensor(target_sizes, dtype=torch.int32), "grids": grids,
                  "num_patches_per_image": counts},
            tensor_type=return_tensors, skip_tensor_conversion=["grids", "num_patches_per_image"])
