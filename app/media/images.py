"""Loading an uploaded image safely: size checked before decoding, EXIF rotation applied, RGB out."""

import os

from PIL import Image, ImageOps

from app import limits
from app.errors import UserError


def load_image(path: str) -> Image.Image:
    name = os.path.basename(path)
    try:
        with Image.open(path) as image:
            # Image.open reads only the header: refuse huge images before their pixels are decoded.
            pixels = image.width * image.height
            if pixels > limits.MAX_IMAGE_PIXELS:
                raise UserError(limits.MSG_IMAGE_TOO_LARGE.format(name=name, limit=limits.MAX_IMAGE_PIXELS))
            image.load()
            upright = ImageOps.exif_transpose(image)
            return upright.convert("RGB")
    except UserError:
        raise
    except Image.DecompressionBombError as error:  # PIL's own guard fires inside open() for the largest ones
        raise UserError(limits.MSG_IMAGE_TOO_LARGE.format(name=name, limit=limits.MAX_IMAGE_PIXELS)) from error
    except (OSError, SyntaxError, ValueError) as error:
        raise UserError(limits.MSG_UNREADABLE_IMAGE.format(name=name)) from error
