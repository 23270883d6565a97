"""Which uploads are images and which are videos, decided by extension before anything is decoded; that an
upload is a local file at all; and which file a video's browser copy (app.media.playback) was made from."""

import os

from app import limits
from app.messages import MSG_NOT_AN_UPLOAD, MSG_UNSUPPORTED_FILE, MSG_UPLOAD_GONE
from app.errors import UserError, displayable

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"  # a PNG's first 8 bytes


def media_kind(path: str) -> str:
    """Return "image" or "video" for a supported upload; raise UserError otherwise."""
    extension = os.path.splitext(path)[1].lower()
    if extension in limits.IMAGE_EXTENSIONS:
        return "image"
    if extension in limits.VIDEO_EXTENSIONS:
        return "video"
    raise unsupported_file(path)


def unsupported_file(path: str) -> UserError:
    """The refusal of a file that is neither a supported image nor a supported video."""
    return UserError(MSG_UNSUPPORTED_FILE.format(
        name=os.path.basename(path),
        images=", ".join(limits.IMAGE_EXTENSIONS),
        videos=", ".join(limits.VIDEO_EXTENSIONS),
    ))


def check_local_file(path) -> None:
    """Refuse anything but an absolute path to a regular file: decoders are never handed a string they
    could read as a URL, a protocol (FFmpeg's `rtsp:`, `concat:`, `pipe:`) or a device. The web side has
    already checked that the file is one of its uploads (app.ui.event_inputs); this holds in the engine
    whoever calls it."""
    if not (isinstance(path, str) and "\0" not in path and os.path.isabs(path)):
        raise UserError(MSG_NOT_AN_UPLOAD.format(name=shown_name(path)))
    if not os.path.lexists(path):  # an upload that expired (app.web.uploads), or a file named that never was
        raise UserError(MSG_UPLOAD_GONE.format(name=shown_name(path)))
    if not os.path.isfile(path):
        raise UserError(MSG_NOT_AN_UPLOAD.format(name=shown_name(path)))


def shown_name(path) -> str:
    """A file's name for a message: its last part, cut short and displayable."""
    name = displayable(os.path.basename(str(path).rstrip("/")) or str(path))
    return name if len(name) <= 80 else name[:77] + "..."


# A video's copy for the browser's player lies beside it, named after it (app.media.playback).
BROWSER_COPY_SUFFIX = ".browser.webm"


def browser_copy_path(path: str) -> str:
    return path + BROWSER_COPY_SUFFIX


def is_browser_copy(path: str) -> bool:
    return ("\0" not in path and path.endswith(BROWSER_COPY_SUFFIX)
            and os.path.isfile(path[: -len(BROWSER_COPY_SUFFIX)]))


def source_of(path: str) -> str:
    """The file the model reads for `path`: the original video for its browser copy, else `path` itself."""
    return path[: -len(BROWSER_COPY_SUFFIX)] if is_browser_copy(path) else path
