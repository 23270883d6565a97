"""The OpenAI-compatible API's images and videos: base64 `data:` URLs decoded into files of the upload folder,
which then go the way of every upload (the same header checks and messages, the same janitor). The app never
fetches a URL: anything but a data URL is refused.

A request is read on a worker thread (app.web.openai_api), and that is not enough: a thread still takes
Python's GIL from the event loop for as long as one call into C lasts, and parsing a 267 MB body in one
json.loads held it 2.3 s, decoding its base64 in one call 1.8 s (dev machine), while every reply of the web
process stood still. So the body's data URLs are lifted out of it before the JSON is parsed (lift_data_urls,
by searches of a few MB each), and each is decoded a few MB at a time, straight into its file. A file is named
by a hash of its bytes, so that a conversation that sends its images again with every request (the API keeps
no state) stores each of them once.
"""

import binascii
import hashlib
import os
import re
import secrets
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
STEP = 2**20  # bytes searched, or base64 characters decoded, in one call into C (about a millisecond of the GIL each)
_URL_FIELD_BEFORE = re.compile(rb'"url"\s*:\s*$')  # what stands before a lifted data URL's string
HEADER_MAX = 256  # a data URL's "data:<media type>;base64," is shorter than this


def lift_data_urls(body: bytes | bytearray) -> tuple[bytes, dict[str, memoryview]]:
    """The body with the string of every `"url": "data:..."` field replaced by a short key, and the data URLs by
    key (views of the body, not copies). A string with JSON escapes other than "\\/" is left in place."""
    view, pieces, lifted, token = memoryview(body), [], {}, secrets.token_hex(8)
    done = at = 0
    while (start := _find(body, b'"data:', at)) >= 0:
        end = _find(body, b'"', start + 1)
        at = start + 1
        if end < 0:
            break  # unterminated: json.loads says so
        if not _URL_FIELD_BEFORE.search(bytes(view[max(0, start - 32):start])):
            continue
        escapes = _count(body, b"\\", start, end)
        if escapes and escapes != _count(body, b"\\/", start, end):
            continue
        key = f"\x00data-url:{token}:{len(lifted)}"
        text = view[start + 1:end]
        lifted[key] = memoryview(bytes(text).replace(b"\\/", b"/")) if escapes else text
        pieces += [view[done:start], b'"\\u0000' + key[1:].encode() + b'"']
        done = at = end + 1
    pieces.append(view[done:])
    return b"".join(pieces), lifted


def _find(body, text: bytes, at: int) -> int:
    """body.find(text, at), a step at a time."""
    while at < len(body):
        found = body.find(text, at, at + STEP + len(text))
        if found >= 0:
            return found
        at += STEP
    return -1


def _count(body, text: bytes, start: int, end: int) -> int:
    """body.count(text, start, end), a step at a time."""
    return sum(body.count(text, at, min(end, at + STEP + len(text) - 1)) for at in range(start, end, STEP))


class DataUrlFiles:
    """Stores the media of data URLs in `folder` (the upload folder) and checks them as uploads are checked;
    `lifted`: the data URLs lift_data_urls took out of the body, by the keys left in their place."""

    def __init__(self, folder: str, lifted: dict[str, memoryview] | None = None):
        self.folder, self.lifted = folder, lifted or {}
        self.stored = 0  # files stored (or found stored) so far

    def store(self, url: str, kind: str, where: str) -> str:
        """The path of a checked file holding the data URL's image or video (`kind`); `where` names the part
        of the request in messages (and the file)."""
        data = self.lifted.get(url)
        if data is None:
            data = _as_bytes(url, where)
        extension, payload = _extension_and_payload(data, kind, where)
        if len(payload) // 4 * 3 > limits.MAX_UPLOAD_MB * 2**20 + 2:  # before decoding it
            raise UserError(MSG_DATA_URL_TOO_LARGE.format(where=where, limit=limits.MAX_UPLOAD_MB))
        path = self._decoded(payload, re.sub(r"[^\w]+", "-", where).strip("-") + extension, where)
        self.stored += 1
        if kind == "image":
            check_image(path)
        else:
            probe_video(path)
        return path

    def _decoded(self, payload: memoryview, name: str, where: str) -> str:
        """The file <folder>/api-<hash of the bytes>/<name> holding the decoded payload: written beside it a
        step at a time, then moved into place, unless it is there (then marked as new, so that the janitor's
        age rule spares it as long as it is used)."""
        os.makedirs(self.folder, exist_ok=True)
        descriptor, partial = tempfile.mkstemp(prefix=".data-url-", dir=self.folder)
        try:
            digest = hashlib.sha256()
            with os.fdopen(descriptor, "wb") as file:
                for at in range(0, len(payload), STEP):  # STEP is a multiple of 4: base64 decodes in whole quads
                    chunk = binascii.a2b_base64(payload[at:at + STEP], strict_mode=True)
                    digest.update(chunk)
                    file.write(chunk)
            folder = os.path.join(self.folder, STORED_PREFIX + digest.hexdigest()[:40])
            path = os.path.join(folder, name)
            if os.path.exists(path):
                os.utime(path)
            else:
                os.makedirs(folder, exist_ok=True)
                os.replace(partial, path)
            return path
        except (binascii.Error, ValueError):
            raise UserError(MSG_DATA_URL_NOT_BASE64.format(where=where)) from None
        finally:
            if os.path.exists(partial):
                os.remove(partial)


def _as_bytes(url: str, where: str) -> memoryview:
    if not url.startswith("data:"):
        shown = url if len(url) <= 60 else url[:57] + "..."
        raise UserError(MSG_NOT_A_DATA_URL.format(where=where, url=shown))
    try:
        return memoryview(url.encode("ascii"))
    except UnicodeEncodeError:
        raise UserError(MSG_DATA_URL_NOT_BASE64.format(where=where)) from None


def _extension_and_payload(data: memoryview, kind: str, where: str) -> tuple[str, memoryview]:
    """(the file's extension for the URL's media type, its base64 payload); UserError for another kind or type."""
    head = bytes(data[:HEADER_MAX])
    comma = head.find(b",")
    parameters = head[len(b"data:"):comma].decode("ascii", "replace").split(";") if comma > 0 else [""]
    if comma < 0 or parameters[-1].strip().lower() != "base64":
        raise UserError(MSG_DATA_URL_NOT_BASE64.format(where=where))
    media_type = parameters[0].strip().lower()
    extension = EXTENSIONS.get(media_type)
    if extension is None or media_kind("file" + extension) != kind:
        raise UserError(MSG_DATA_URL_TYPE.format(where=where, type=media_type or "none", kind=kind,
                                                 kinds=", ".join(_media_types(kind))))
    return extension, data[comma + 1:]


def _media_types(kind: str) -> list[str]:
    """The media types of `kind` ("image" or "video") a data URL may carry, one for each extension."""
    shown = {}
    for media_type, extension in EXTENSIONS.items():
        if media_kind("file" + extension) == kind:
            shown.setdefault(extension, media_type)
    return list(shown.values())
