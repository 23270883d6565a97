"""Images resized and cut into slices on the engine's GPU, JPEGs decoded there too: the uint8 slices the app's
processor makes on a CPU core (app.engine.processor._uint8_slices), laid out the same, for a request a preparer
left them to (app.engine.jpegs_on_device). docs/DECISIONS.md D43.

Decoding is nvJPEG's, through torchvision; other images come decoded by their preparer. The resize is the
processor's, torchvision's bicubic resize with
antialiasing of a uint8 image, as PyTorch computes it on the CPU: in fixed point, int16 weights at a
precision chosen from the largest weight, the width first then the height, each pass rounded and clamped
back to uint8 (aten/src/ATen/native/cpu/UpSampleKernel.cpp, _compute_index_ranges_int16_weights). On CUDA
the same call runs in float32 and rounds once, 1-2 levels off on 12-18% of the pixels; here each pass is a
float64 product with the weights as a dense matrix, exact for these integers, so that on the same decoded
image the slices are the processor's bit for bit (tests/test_jpeg_on_device.py).
"""

import functools
import logging
import math
import os

import numpy
import torch

from app.engine.processor import image_patches
from app.engine.jpegs_on_device import DeferredImages
from app.errors import UserError
from app.media.budget import ImageSlicing
from app.media.files import check_local_file
from app.media.images import quiet_torchvision_decoding
from app.messages import MSG_UNREADABLE_IMAGE

log = logging.getLogger(__name__)

CPU = torch.device("cpu")


def slices(deferred: DeferredImages, device, resize=None, pixels: torch.Tensor | None = None) -> torch.Tensor:
    """The request's pixel_values [1, 3, patch, tokens * patch] in uint8 on `device`, as the processor makes
    them: each image's source view then its slices, image after image. JPEGs are decoded from their files,
    the other images taken from `pixels`, their preparer's decoding (the request's DECODED_PIXELS). Resized by
    `resize` (images, height, width), by default `resized` on a GPU and on the CPU the processor's own call,
    which is faster there. A JPEG that cannot be decoded is refused with the app's message for an unreadable image."""
    resize = resize or (resized if device.type != "cpu" else processor_resized)
    jpegs = iter(decoded(tuple(path for path, place in zip(deferred.paths, deferred.decoded) if place is None), device))
    views = []
    for path, place, slicing in zip(deferred.paths, deferred.decoded, deferred.slicings):
        if place is None:
            image = next(jpegs)
        else:
            offset, shape = place
            image = pixels[offset:offset + torch.Size(shape).numel()].view(shape).to(device).permute(2, 0, 1)
        if tuple(image.shape[-2:]) != slicing.size:  # not what its header said: its tokens would not fit
            raise UserError(MSG_UNREADABLE_IMAGE.format(name=os.path.basename(path)))
        views.append(image_views(image, slicing, deferred.patch_size, resize))
    return torch.cat(views, dim=-1).unsqueeze(0)


def decoded(paths: tuple[str, ...], device) -> list[torch.Tensor]:
    """Each JPEG as RGB uint8 [3, height, width] on `device`: on CUDA by nvJPEG, all in one call; on the
    CPU by libjpeg-turbo, as app.media.images.load_image_pixels decodes it, which is also where a JPEG
    that nvJPEG refuses goes."""
    from torchvision.io import ImageReadMode, decode_jpeg

    quiet_torchvision_decoding()
    encoded = [_read(path) for path in paths]
    if device.type == "cuda" and encoded:
        try:
            return decode_jpeg(encoded, mode=ImageReadMode.RGB, device=device)
        except RuntimeError as error:
            log.warning("nvJPEG could not decode %s (%s): decoding on the CPU", ", ".join(map(os.path.basename, paths)), error)
    images = []
    for path, data in zip(paths, encoded):
        try:
            images.append(decode_jpeg(data, mode=ImageReadMode.RGB).to(device))
        except RuntimeError as error:  # corrupt or truncated past its header
            raise UserError(MSG_UNREADABLE_IMAGE.format(name=os.path.basename(path))) from error
    return images


def _read(path: str) -> torch.Tensor:
    from torchvision.io import read_file

    check_local_file(path)  # gone since it was prepared (an expired upload): the usual message
    try:
        return read_file(path)
    except RuntimeError as error:
        raise UserError(MSG_UNREADABLE_IMAGE.format(name=os.path.basename(path))) from error


def image_views(image: torch.Tensor, slicing: ImageSlicing, patch: int, resize) -> torch.Tensor:
    """One image's source view and slices, each cut into patches as image_patches cuts it, side by side:
    [3, patch, tokens * patch]. The slices are cut out of the refined image by one reshape, in the order
    of transformers' divide_to_patches (row after row)."""
    source = image_patches(resize(image, *slicing.source), patch)
    if not slicing.grid:
        return source
    refined = resize(image, *slicing.refined)
    rows, cols = slicing.grid
    height, width = slicing.slice_size
    cut = refined.reshape(3, rows, height // patch, patch, cols, width // patch, patch)
    return torch.cat([source, cut.permute(0, 3, 1, 4, 2, 5, 6).reshape(3, patch, -1)], dim=-1)


def resized(image: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """uint8 [channels, h, w] resized as the processor resizes it on the CPU (see above), on its device."""
    if image.shape[-1] != width:
        image = _resized_along(image, width, last=True)
    if image.shape[-2] != height:
        image = _resized_along(image, height, last=False)
    return image


def processor_resized(image: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """The processor's own resize (transformers' TorchvisionBackend.resize), for images on the CPU."""
    from torchvision.transforms.v2 import functional

    return functional.resize(image, [height, width], interpolation=functional.InterpolationMode.BICUBIC, antialias=True)


# A pass's float64 work in pieces of at most this many input pixels (128 MB): a 64-megapixel image would
# otherwise take 1.5 GB of the GPU at once.
_PASS_PIXELS = 2**24


def _resized_along(image: torch.Tensor, size: int, last: bool) -> torch.Tensor:
    """One pass: the width (`last`) or the height to `size`, rounded and clamped to uint8 as the CPU's."""
    length = image.shape[-1] if last else image.shape[-2]
    columns, taps, precision = _axis_taps_on(length, size, image.device)
    weights = torch.zeros((size, length), dtype=torch.float64, device=image.device).scatter_add_(1, columns, taps)
    across = -2 if last else -1  # the pieces: rows for the width's pass, columns for the height's
    pieces = image.split(max(1, _PASS_PIXELS // (image.shape[0] * length)), dim=across)
    return torch.cat([_pass(piece, weights, precision, last) for piece in pieces], dim=across)


def _pass(image: torch.Tensor, weights: torch.Tensor, precision: int, last: bool) -> torch.Tensor:
    pixels = image.double()
    sums = pixels @ weights.T if last else weights @ pixels
    return sums.add_(1 << (precision - 1)).div_(1 << precision).floor_().clamp_(0, 255).to(torch.uint8)


@functools.lru_cache(maxsize=64)
def _axis_taps_on(length: int, size: int, device) -> tuple[torch.Tensor, torch.Tensor, int]:
    """_axis_taps on `device` (kept there: the common sizes recur), each tap as its input's index [size, taps]."""
    first, taps, precision = _axis_taps(length, size)
    columns = (first[:, None] + torch.arange(taps.shape[1])).clamp_(max=length - 1)  # past the end: weight 0
    return columns.to(device), taps.to(device), precision


def _axis_taps(length: int, size: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """For resizing an axis of `length` pixels to `size` (bicubic, antialiased): each output's first input
    index [size], its int16 weights [size, taps] (as float64, 0 past its last input) and their precision in
    bits. In double precision, in the CPU kernel's order of operations, so that the weights are its own."""
    scale = length / size
    support = 2.0 * scale if scale >= 1.0 else 2.0  # the cubic's reach, widened by the scale when shrinking
    taps = math.ceil(support) * 2 + 1
    inverse = 1.0 / scale if scale >= 1.0 else 1.0
    center = scale * (numpy.arange(size) + 0.5)
    first = numpy.maximum((center - support + 0.5).astype(numpy.int64), 0)
    count = numpy.clip(numpy.minimum((center + support + 0.5).astype(numpy.int64), length) - first, 0, taps)
    offsets = numpy.arange(taps)
    inside = offsets[None, :] < count[:, None]
    weights = numpy.where(inside, _keys_cubic(((offsets[None, :] + first[:, None]) - center[:, None] + 0.5) * inverse), 0.0)
    total = numpy.zeros(size)
    for tap in range(taps):  # summed in order, as the kernel sums them
        total = total + weights[:, tap]
    weights = numpy.where(total[:, None] != 0.0, weights / numpy.where(total == 0.0, 1.0, total)[:, None], weights)
    largest = weights.max()
    precision = 0
    while precision < 22 and int(0.5 + largest * (1 << (precision + 1))) < 1 << 15:
        precision += 1
    scaled = weights * (1 << precision)
    rounded = numpy.where(scaled < 0, numpy.trunc(scaled - 0.5), numpy.trunc(scaled + 0.5))
    return torch.from_numpy(first), torch.from_numpy(rounded), precision


def _keys_cubic(x: numpy.ndarray) -> numpy.ndarray:
    """The bicubic filter with a = -0.5 (Keys'; PyTorch's and PIL's with antialiasing)."""
    a = -0.5
    x = numpy.abs(x)
    near = ((a + 2) * x - (a + 3)) * x * x + 1
    far = ((a * x - 5 * a) * x + 8 * a) * x - 4 * a
    return numpy.where(x < 1.0, near, numpy.where(x < 2.0, far, 0.0))


class JpegsOnDevice:
    """Deferred JPEGs made into pixels on the GPU as their request is staged (BatchRunner.stage_media), on
    the thread that prepared it: an error there fails that request alone, as a preparer's would, and the
    scheduler's thread never waits for nvJPEG (torchvision's decoder waits for its own stream)."""

    enabled = True

    def __init__(self, device):
        self.device = device

    def pixels(self, deferred: DeferredImages, decoded_pixels, staging):
        """The request's pixel_values: made on the GPU and held as staged pixels, or, where the staged
        pixels are at their limit, made on this CPU as a preparer makes them and copied in their wave."""
        staged = staging.make(deferred.pixel_bytes, lambda: slices(deferred, self.device, pixels=decoded_pixels))
        return staged if staged is not None else slices(deferred, CPU, pixels=decoded_pixels)


class NoJpegsOnDevice:
    """Where the preparers decode JPEGs as every other image (the CPU, ZeroGPU, tuning.JPEG_ON_DEVICE off,
    or a torchvision that cannot decode on this GPU). A request prepared for another runner that did
    (across a model switch) still gets its pixels: made on this CPU."""

    enabled = False

    @staticmethod
    def pixels(deferred: DeferredImages, decoded_pixels, staging) -> torch.Tensor:
        return slices(deferred, CPU, pixels=decoded_pixels)


def jpegs_for(device, wanted: bool):
    """JpegsOnDevice where `wanted` and a small JPEG decodes and slices on `device`, once, at the model's
    load (which also makes nvJPEG's decoder ready); else NoJpegsOnDevice."""
    if not wanted:
        return NoJpegsOnDevice()
    from torchvision.io import ImageReadMode, decode_jpeg, encode_jpeg

    try:
        quiet_torchvision_decoding()
        image = decode_jpeg(encode_jpeg(torch.full((3, 64, 96), 128, dtype=torch.uint8)), mode=ImageReadMode.RGB, device=device)
        resized(image, 56, 84)
        torch.cuda.synchronize(device)
    except Exception as error:  # whatever this torchvision or GPU lacks: the model loads and serves all the same
        log.warning("JPEGs are decoded on the CPU: torchvision cannot decode them on %s (%s)", device, error)
        return NoJpegsOnDevice()
    log.info("JPEGs are decoded, resized and sliced on %s (nvJPEG)", device)
    return JpegsOnDevice(device)
