"""Which uploads are images and which are videos, decided by extension before anything is decoded."""

import os

from app import limits
from app.errors import UserError


def media_kind(path: str) -> str:
    """Return "image" or "video" for a supported upload; raise UserError otherwise."""
    extension = os.path.splitext(path)[1].lower()
    if extension in limits.IMAGE_EXTENSIONS:
        return "image"
    if extension in limits.VIDEO_EXTENSIONS:
        return "video"
    raise UserError(limits.MSG_UNSUPPORTED_FILE.format(
        name=os.path.basename(path),
        images=", ".join(limits.IMAGE_EXTENSIONS),
        videos=", ".join(limits.VIDEO_EXTENSIONS),
    ))
