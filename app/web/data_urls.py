"""The OpenAI-compatible API's images and videos: base64 `data:` URLs decoded into files of the upload folder,
which then go the way of every upload (the same header checks and messages, the same janitor). The app never
fetches a URL: anything but a data URL is refused.

A file is named by a hash of its bytes, so that a conversation that sends its images again with every
request (the API keeps no state) stores each of them once. Decoding runs on a worker thread of the caller's
choosing (app.web.openai_api), never on the event loop: a 200 MB video is 270 MB of base64.
"""

import base64
import binascii
import hashlib
import os
import re
import tempfile

from app import limits
from app.errors import UserError
from app.media.files import media_kind
from app.media.images import check_image
from app.media.video import probe_video
from app.messages import MSG_DATA_URL_NOT_BASE64, MSG_DATA_URL_TOO_LARGE, MSG_DATA_URL_TYPE, MSG_NOT_A_DATA_URL

# The media types a data URL may carry, by the extension the app's media checks know them by.
EXTENSIONS = {
    "image/jpeg": ".jpg", "image/jpg": ".jpg", "image/pjpeg": ".jpg", "image/png": ".png", "image/x-png": ".png",
    "image/webp": ".webp", "image/bmp": ".bmp", "image/x-ms-bmp": ".bmp", "image/gif": ".gif", "image/tiff": ".tiff",
    "video/mp4": ".mp4", "video/webm": ".webm", "video/quicktime": ".mov", "video/x-msvideo": ".avi",
    "video/avi": ".avi", "video/x-matroska": ".mkv", "video/matroska": ".mkv",
}
STORED_PREFIX = "api-"  # the folder of a file decoded from a data URL: api-<its bytes' hash>/


def media_type_and_payload(url: str, where: str) -> tuple[str, str]:
    """(media type, base64 payload) of a data URL; UserError for anything else (a link is never fetched)."""
    if not url.startswith("data:"):
        shown = url if len(url) <= 60 else url[:57] + "..."
        raise UserError(MSG_NOT_A_DATA_URL.format(where=where, url=shown))
    header, comma, payload = url[len("data:"):].partition(",")
    parameters = header.split(";")
    if not comma or parameters[-1].strip().lower() != "base64":
        raise UserError(MSG_DATA_URL_NOT_BASE64.format(where=where))
    return parameters[0].strip().lower(), payload


def _media_types(kind: str) -> list[str]:
    """The media types of `kind` ("image" or "video") a data URL may carry, one for each extension."""
    shown = {}
    for media_type, extension in EXTENSIONS.items():
        if media_kind("file" + extension) == kind:
            shown.setdefault(extension, media_type)
    return list(shown.values())


class DataUrlFiles:
    """Stores the media of data URLs in `folder` (the upload folder) and checks them as uploads are checked."""

    def __init__(self, folder: str):
        self.folder = folder

    def store(self, url: str, kind: str, where: str) -> str:
        """The path of a checked file holding the data URL's image or video (`kind`); `where` names the part
        of the request in messages (and the file)."""
        media_type, payload = media_type_and_payload(url, where)
        extension = EXTENSIONS.get(media_type)
        if extension is None or media_kind("file" + extension) != kind:
            raise UserError(MSG_DATA_URL_TYPE.format(where=where, type=media_type or "none", kind=kind,
                                                     kinds=", ".join(_media_types(kind))))
        limit = limits.MAX_UPLOAD_MB * 2**20
        if len(payload) // 4 * 3 > limit + 2:  # before decoding it
            raise UserError(MSG_DATA_URL_TOO_LARGE.format(where=where, limit=limits.MAX_UPLOAD_MB))
        try:
            data = base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            raise UserError(MSG_DATA_URL_NOT_BASE64.format(where=where)) from None
        if len(data) > limit:
            raise UserError(MSG_DATA_URL_TOO_LARGE.format(where=where, limit=limits.MAX_UPLOAD_MB))
        path = self._written(data, re.sub(r"[^\w]+", "-", where).strip("-") + extension)
        if kind == "image":
            check_image(path)
        else:
            probe_video(path)
        return path

    def _written(self, data: bytes, name: str) -> str:
        """The file <folder>/api-<hash of data>/<name>, written unless it is there (then marked as new, so
        that the janitor's age rule spares it as long as it is used)."""
        folder = os.path.join(self.folder, STORED_PREFIX + hashlib.sha256(data).hexdigest()[:40])
        path = os.path.join(folder, name)
        try:
            os.utime(path)
            return path
        except FileNotFoundError:
            pass
        os.makedirs(folder, exist_ok=True)
        # Written beside it, then moved into place: a request reading it meanwhile never sees half of it.
        descriptor, partial = tempfile.mkstemp(prefix=".", dir=folder)
        try:
            with os.fdopen(descriptor, "wb") as file:
                file.write(data)
            os.replace(partial, path)
        except BaseException:
            if os.path.exists(partial):
                os.remove(partial)
            raise
        return path
