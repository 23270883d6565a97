"""Loading an uploaded image safely: size checked before decoding, EXIF rotation applied, RGB out."""

import functools
import os
import warnings
from contextlib import contextmanager
from dataclasses import dataclass

from PIL import ExifTags, Image, ImageOps

from app import limits
from app.messages import MSG_IMAGE_TOO_LARGE, MSG_IMAGE_TOO_THIN, MSG_UNREADABLE_IMAGE
from app.errors import UserError
from app.media.files import PNG_SIGNATURE, check_local_file

# Decoded by torchvision (libjpeg-turbo) straight into the tensor the image processor takes, with no PIL image
# to convert (docs/DECISIONS.md D11). Not PNG: torchvision's libpng decoder ends the whole process on a
# corrupt PNG rather than raising (D52). A PNG of 8-bit RGB, with nothing to turn or make transparent, is
# decoded by libspng where the caller may hold the GIL, else by OpenCV (D53); any other by PIL.
_TENSOR_DECODED_FORMATS = ("JPEG",)
_PNG_RGB8 = (8, 2)  # IHDR's bit depth and colour type
WHITE = (255, 255, 255, 255)


def load_image(path: str) -> Image.Image:
    """The image as an upright RGB PIL image, what is transparent in it on white."""
    with _opened(path) as (image, _):
        image.load()
        return _rgb_on_white(ImageOps.exif_transpose(image))


def _rgb_on_white(image: Image.Image) -> Image.Image:
    """RGB, a transparent image laid on white as a page shows it: dropping its alpha turns what is
    transparent into whatever colour lies under it, most often black (black text on a transparent
    background became a black square). docs/DECISIONS.md D52."""
    if image.mode in ("RGBA", "LA", "PA", "RGBa", "La") or "transparency" in image.info:
        try:
            with_alpha = image.convert("RGBA")
        except ValueError:  # a mode PIL cannot give an alpha (16-bit grey with a transparent value): as it is
            return image.convert("RGB")
        return Image.alpha_composite(Image.new("RGBA", image.size, WHITE), with_alpha).convert("RGB")
    return image.convert("RGB")


# EXIF orientations that turn the image a quarter (transposed, rotated 90 or 270 degrees, transversed).
_QUARTER_TURNS = (5, 6, 7, 8)


def image_size(path: str) -> tuple[int, int]:
    """(height, width) of the image upright, as load_image gives it, from its header alone."""
    with _opened(path) as (image, png):
        turned = _orientation(image, png) in _QUARTER_TURNS
        return (image.width, image.height) if turned else (image.height, image.width)


def _orientation(image: Image.Image, png: "PngLayout | None") -> int:
    """The image's EXIF orientation (1: upright), without decoding its pixels: for a PNG without an eXIf chunk
    before its pixels, PIL's getexif() decodes the whole image to look for one after them (an 8000x8000 PNG:
    0.9 s and 275 MB), so a PNG's is taken from its chunks (`png`, _png_layout) instead."""
    return png.orientation if png is not None else image.getexif().get(ExifTags.Base.Orientation, 1)


@dataclass(frozen=True)
class PngLayout:
    """What a PNG's chunk headers say, read without its pixels."""

    bit_depth: int
    colour_type: int
    orientation: int  # its eXIf chunk's, wherever it lies; 1 (upright) without one


def _png_layout(path: str) -> PngLayout | None:
    """A PNG's layout from its chunk headers, read one by one; None for a file that is no PNG. Refused as
    unreadable: IHDR not first, two eXIf chunks (PIL's preview and the model would each take another one), or
    more than MAX_PNG_CHUNKS chunks (16.6 M empty ones, 199 MB, held PIL's opening 49 s and 2.9 GB)."""
    refused = UserError(MSG_UNREADABLE_IMAGE.format(name=os.path.basename(path)))
    with open(path, "rb") as file:
        if file.read(len(PNG_SIGNATURE)) != PNG_SIGNATURE:
            return None
        ihdr = file.read(8 + 13 + 4)  # its length, its type, its 13 bytes, its checksum
        if len(ihdr) < 25 or ihdr[4:8] != b"IHDR":
            raise refused
        orientation = None
        for _ in range(limits.MAX_PNG_CHUNKS):
            header = file.read(8)
            if len(header) < 8 or header[4:] == b"IEND":
                return PngLayout(bit_depth=ihdr[16], colour_type=ihdr[17], orientation=orientation or 1)
            length = int.from_bytes(header[:4], "big")
            if header[4:] != b"eXIf":
                file.seek(length + 4, os.SEEK_CUR)  # the data and its checksum
            elif orientation is None:
                exif = Image.Exif()
                exif.load(file.read(length))
                orientation = exif.get(ExifTags.Base.Orientation, 1)
                file.seek(4, os.SEEK_CUR)
            else:
                raise refused
    raise refused


def load_thumbnail(path: str, longest_side: int) -> Image.Image:
    """The image upright in RGB, shrunk to at most `longest_side` pixels a side (JPEGs decoded at a fraction
    of their size: a preview costs the web process little)."""
    with _opened(path) as (image, _):
        image.draft("RGB", (longest_side, longest_side))
        upright = _rgb_on_white(ImageOps.exif_transpose(image))
    upright.thumbnail((longest_side, longest_side))
    return upright


def check_image(path: str) -> None:
    """Refuse what load_image would refuse from the file's header alone (not an image, too many
    pixels), without decoding the pixels. A file whose pixels are broken past its header is refused
    when they are decoded for the model, with the same message."""
    with _opened(path):
        pass


def load_image_pixels(path: str, may_hold_gil: bool = False):
    """The image as an upright RGB uint8 tensor [3, height, width], as load_image's pixels, faster for
    JPEG and 8-bit RGB PNG. Other formats go through PIL. `may_hold_gil`: no other thread of this process
    waits to run (a preparing worker process), so the faster PNG decoder, which holds the GIL, may be used."""
    with _opened(path) as (image, png):
        image_format = image.format
        plain = png is not None and "transparency" not in image.info and png.orientation == 1
    if plain and (png.bit_depth, png.colour_type) == _PNG_RGB8:
        return _rgb_png_pixels(path, may_hold_gil)
    decode = _tensor_decoder()
    if image_format in _TENSOR_DECODED_FORMATS and decode is not None:
        try:
            pixels = decode(path)
        except RuntimeError as error:  # corrupt or truncated: what PIL reports as OSError
            raise UserError(MSG_UNREADABLE_IMAGE.format(name=os.path.basename(path))) from error
        if pixels.dtype.itemsize == 1:
            return pixels
    from torchvision.transforms.functional import pil_to_tensor

    return pil_to_tensor(load_image(path))


def _rgb_png_pixels(path: str, may_hold_gil: bool):
    """An 8-bit RGB PNG's pixels [3, height, width] (lossless: any sound decoder gives the same), as a view
    of the decoder's rows of pixels, as torchvision's decoders give: the engine takes them in that order.
    libspng decodes in about 65% of OpenCV's time, but holds the GIL, which would stall every other thread of
    an engine that prepares on threads (D53). Each refuses a corrupt PNG."""
    import torch

    pixels = _png_by_libspng(path) if may_hold_gil else _png_by_opencv(path)
    if pixels is None:
        raise UserError(MSG_UNREADABLE_IMAGE.format(name=os.path.basename(path)))
    return torch.from_numpy(pixels).permute(2, 0, 1)


def _png_by_libspng(path: str):
    """libspng's pixels, the rows inflated by libdeflate where it can (app.media.png_rows, D58)."""
    import pyspng

    from app.media.png_rows import with_rows_stored

    with open(path, "rb") as file:
        data = file.read()
    data = with_rows_stored(data) or data  # the file's bytes let go: libspng holds a copy of what it is given
    try:
        return pyspng.load(data, "RGB")
    except RuntimeError:
        return None


def _png_by_opencv(path: str):
    import cv2
    import numpy as np

    flags = cv2.IMREAD_IGNORE_ORIENTATION | getattr(cv2, "IMREAD_COLOR_RGB", cv2.IMREAD_COLOR)
    pixels = cv2.imdecode(np.fromfile(path, np.uint8), flags)
    if pixels is not None and not hasattr(cv2, "IMREAD_COLOR_RGB"):  # OpenCV before 4.11 decodes to BGR only
        cv2.cvtColor(pixels, cv2.COLOR_BGR2RGB, dst=pixels)
    return pixels


# What the engine's GPU decoder (app.model.jpegs, nvJPEG) decodes as load_image_pixels does: the JPEGs whose
# three components are YCbCr (no Adobe marker saying RGB or YCCK, no components named R, G, B: libjpeg reads
# those as RGB), that need no EXIF turn or flip, and that end where a JPEG ends (a truncated one is refused
# on the CPU; nvJPEG might fill in what is missing). docs/DECISIONS.md D43.
_RGB_COMPONENT_IDS = (ord("R"), ord("G"), ord("B"))
_JPEG_END = b"\xff\xd9"


def jpeg_for_the_device(path: str) -> tuple[int, int] | None:
    """(height, width) of a JPEG that the engine may decode on its GPU (see above), from its header and its
    last bytes; None for any other image. Refuses what check_image refuses."""
    with _opened(path) as (image, png):
        if image.format != "JPEG" or image.mode != "RGB" or image.info.get("adobe_transform", 1) != 1:
            return None
        if tuple(layer[0] for layer in getattr(image, "layer", ())) == _RGB_COMPONENT_IDS:
            return None
        if _orientation(image, png) != 1:
            return None
        size = (image.height, image.width)
    with open(path, "rb") as file:
        file.seek(-len(_JPEG_END), os.SEEK_END)
        return size if file.read() == _JPEG_END else None


def check_shape(name: str, width: int, height: int) -> None:
    """Refuse an image (or a video's frames) whose long side is more than MAX_IMAGE_ASPECT_RATIO times its short one."""
    if max(width, height) > limits.MAX_IMAGE_ASPECT_RATIO * max(1, min(width, height)):
        raise UserError(MSG_IMAGE_TOO_THIN.format(name=name, width=width, height=height,
                                                         limit=limits.MAX_IMAGE_ASPECT_RATIO))


@contextmanager
def _opened(path: str):
    """(the image, opened (only its header read) and checked, and a PNG's layout, read first: its chunks are
    counted before PIL reads them); errors become the user's messages."""
    check_local_file(path)
    name = os.path.basename(path)
    try:
        png = _png_layout(path)
        with Image.open(path) as image:
            # Image.open reads only the header: refuse huge images before their pixels are decoded.
            pixels = image.width * image.height
            if pixels > limits.MAX_IMAGE_PIXELS:
                raise UserError(MSG_IMAGE_TOO_LARGE.format(name=name, limit=limits.MAX_IMAGE_PIXELS))
            check_shape(name, image.width, image.height)
            yield image, png
    except UserError:
        raise
    except Image.DecompressionBombError as error:  # PIL's own guard fires inside open() for the largest ones
        raise UserError(MSG_IMAGE_TOO_LARGE.format(name=name, limit=limits.MAX_IMAGE_PIXELS)) from error
    except (OSError, SyntaxError, ValueError) as error:
        raise UserError(MSG_UNREADABLE_IMAGE.format(name=name)) from error


@functools.cache
def _tensor_decoder():
    """torchvision's decoder as path -> tensor, or None where this torchvision no longer has it (0.29
    deprecates it for TorchCodec's)."""
    try:
        from torchvision.io import ImageReadMode, decode_image, read_file
    except ImportError:
        return None
    quiet_torchvision_decoding()
    return lambda path: decode_image(read_file(path), mode=ImageReadMode.RGB, apply_exif_orientation=True)


@functools.cache
def quiet_torchvision_decoding() -> None:
    """torchvision 0.29 warns at every decode that its decoders are deprecated (for TorchCodec's): silenced
    once for the process."""
    warnings.filterwarnings("ignore", message="The image decoding and encoding capabilities of TorchVision",
                            category=DeprecationWarning)
