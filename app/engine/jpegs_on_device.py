"""Images whose slices the engine makes on its GPU: what a preparer hands over in place of their pixels, and
the processor's view of such a request (each image's slice sizes and grid, no pixels).

The prompt's ids depend on an image's size alone (app.media.budget plans the same cut from the header), so
a preparer renders the prompt as always and leaves resizing and slicing to the engine, which makes the same
uint8 slices on its GPU (app.model.jpegs) when it stages the request's pixels. A JPEG that nvJPEG decodes as
the CPU does is left whole, as its file; any other image the preparer decodes (libpng, PIL: a 1344x1344 PNG in
20-35 ms of a core), and hands over its decoded pixels, whose slicing on a core took about as long again.
No torch at import, as everywhere in app.engine. docs/DECISIONS.md D43.
"""

from dataclasses import dataclass

from app.media.budget import ImageSlicing

# The key of a prepared request's tensors that holds its DeferredImages in place of "pixel_values", and the one
# that holds the pixels its preparer decoded, every such image's back to back (uint8, flat: a preparing worker
# hands a tensor of the request's tensors back through shared memory, app.engine.preparers).
DEFERRED_IMAGES = "images_for_the_device"
DECODED_PIXELS = "decoded_pixels"
# A request hands the engine its images' decoded pixels up to this many bytes (a 1344x1344 PNG's are 5.4 MB, and a
# preparing worker's shared slot holds 8: app.engine.preparers.PIXEL_SLOT_BYTES); past it, its preparer slices
# them as before, the slices at most about 6 MB a request (the slice budget): 16 images of 64 megapixels would
# otherwise send 3 GB of pixels through the engine's memory.
DECODED_PIXELS_MAX_BYTES = 8 * 2**20


@dataclass(frozen=True)
class DeferredImages:
    """A request's images in prompt order, with how the processor cuts each (its source view and slices), and
    where each one's pixels come from: None for a JPEG the engine decodes from its file
    (app.media.images.jpeg_for_the_device), else (offset, (height, width, 3)) in the request's DECODED_PIXELS."""

    paths: tuple[str, ...]
    slicings: tuple[ImageSlicing, ...]
    patch_size: int
    decoded: tuple

    @property
    def pixel_bytes(self) -> int:
        """The bytes of their uint8 slices, as the processor would have made them."""
        return 3 * sum(_view_pixels(slicing) for slicing in self.slicings)

    def after(self, count: int) -> "DeferredImages":
        """The images after the first `count` (those a kept conversation holds are not made again)."""
        return DeferredImages(self.paths[count:], self.slicings[count:], self.patch_size, self.decoded[count:])


def _view_pixels(slicing: ImageSlicing) -> int:
    pixels = slicing.source[0] * slicing.source[1]
    if slicing.grid:
        pixels += slicing.slice_count * slicing.slice_size[0] * slicing.slice_size[1]
    return pixels


def deferred_images(paths: list[str], loaded: list, slicings: tuple[ImageSlicing, ...], patch_size: int) -> dict:
    """The tensors that stand for a request's images, whose slices the engine makes: each JPEG as its file
    (`loaded` holds its (height, width)), each other image's decoded pixels back to back in one flat tensor."""
    import torch

    decoded, pixels, offset = [], [], 0
    for image in loaded:
        if isinstance(image, tuple):
            decoded.append(None)
        else:
            # Rows of pixels, as the decoders lay them out: flattened without a copy (channel by channel, a 1344x1344
            # PNG's was 3-9 ms of a core, and joining the images 9-30 ms more, which one image now skips).
            rows = image.permute(1, 2, 0)
            decoded.append((offset, tuple(rows.shape)))
            pixels.append(rows.reshape(-1))
            offset += rows.numel()
    tensors = {DEFERRED_IMAGES: DeferredImages(tuple(paths), slicings, patch_size, tuple(decoded))}
    if pixels:
        tensors[DECODED_PIXELS] = pixels[0] if len(pixels) == 1 else torch.cat(pixels)
    return tensors


def defers_jpegs(processor) -> bool:
    """Whether the engine can make this processor's pixels from a JPEG: MiniCPM-V 4.6's image processor
    leaving uint8 slices (app.engine.processor._leave_images_unnormalized), resized bicubic, which is the
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
    returns them (app.engine.processor._uint8_slices), and no pixels. Everything else is the image
    processor's own."""

    def __init__(self, image_processor, slicings: tuple[ImageSlicing, ...]):
        self._image_processor = image_processor
        self._slicings = slicings

    def __getattr__(self, name):
        if name == "_image_processor":  # not set yet: an object being copied or unpickled
            raise AttributeError(name)
        return getattr(self._image_processor, name)

    def __call__(self, images, return_tensors=None, **kwargs):
        import torch
        from transformers.image_processing_utils import BatchFeature

        patch = self._image_processor.patch_size
        target_sizes, grids, counts = [], [], []
        for slicing in self._slicings:
            target_sizes += slicing.views_in_patches(patch)
            grids.append(list(slicing.grid) if slicing.grid else [0, 0])
            counts.append(1 + slicing.slice_count)
        return BatchFeature(
            data={"target_sizes": torch.tensor(target_sizes, dtype=torch.int32), "grids": grids,
                  "num_patches_per_image": counts},
            tensor_type=return_tensors, skip_tensor_conversion=["grids", "num_patches_per_image"])
