"""The MCP tools' files (app.ui.mcp_tools). Each comes as a string: the file itself in base64 (bare, or as a
data: URL), or the path of a file uploaded to this app.

Base64 is decoded into the upload folder, as an upload is stored (a folder of its own, named at random), held
to the same size limit (limits.MAX_UPLOAD_MB), and its type is read from its first bytes (bare base64 names
none, and a data: URL's media type is not trusted either). A path must lie in the upload folder, as every
event's files must (app.ui.event_inputs). Anything else, a link above all, is refused with a message: nothing
here fetches a URL or opens a path outside the upload folder. Callers decode in a thread, not in the server's
event loop (a few megabytes of base64 take milliseconds).
"""

import base64
import binascii
import os
import re
import secrets
import shutil

from app import limits
from app.errors import UserError
from app.media.files import PNG_SIGNATURE, shown_name, unsupported_file
from app.messages import MSG_FILE_TOO_LARGE, MSG_INLINE_LINK, MSG_INLINE_NOT_A_FILE, MSG_NOT_AN_UPLOAD
from app.ui.event_inputs import inside_folder

# A URL's scheme (http:, file:, rtsp:, FFmpeg's concat: ...): base64 never holds a colon.
_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.-]+:")
_DATA_URL = re.compile(r"data:[^,]*;base64,", re.IGNORECASE)
_URL_SAFE = str.maketrans("-_", "+/")  # base64's URL-safe alphabet, read as well as the standard one
# Formats by their first bytes (app.media.files.media_kind knows them by extension); RIFF, ISO media and
# Matroska files are told apart in sniffed_extension.
_SIGNATURES = ((PNG_SIGNATURE, ".png"), (b"\xff\xd8\xff", ".jpg"), (b"GIF87a", ".gif"), (b"GIF89a", ".gif"),
               (b"II*\x00", ".tiff"), (b"MM\x00*", ".tiff"), (b"BM", ".bmp"))
SHOWN_CHARS = 60  # of a refused string, in its message


def sniffed_extension(data: bytes) -> str | None:
    """The extension of the supported image or video format that `data` begins with, or None."""
    head = data[:64]
    if head.startswith(b"RIFF"):
        return {b"WEBP": ".webp", b"AVI ": ".avi"}.get(head[8:12])
    if head[4:8] == b"ftyp":  # ISO media: QuickTime's brand is "qt  ", MP4's are many
        return ".mov" if head[8:12] == b"qt  " else ".mp4"
    if head.startswith(b"\x1a\x45\xdf\xa3"):  # Matroska, of which WebM is a profile its header names
        return ".webm" if b"webm" in head else ".mkv"
    return next((extension for signature, extension in _SIGNATURES if head.startswith(signature)), None)


def _shown(text: str) -> str:
    return text if len(text) <= SHOWN_CHARS else text[:SHOWN_CHARS - 3] + "..."


def _unwrapped(payload: str) -> str:
    """Base64 without the line breaks it may be wrapped at (any other whitespace makes it no base64)."""
    return payload.replace("\r", "").replace("\n", "")


def _base64_bytes(payload: str, name: str) -> bytes | None:
    """The bytes `payload` (base64 without whitespace) encodes; None if it is not base64. Refused before
    decoding if they would be over the upload limit."""
    limit_bytes = limits.MAX_UPLOAD_MB * 2**20
    if len(payload) // 4 * 3 > limit_bytes:
        raise UserError(MSG_FILE_TOO_LARGE.format(name=name, size_mb=len(payload) * 3 / 4 / 2**20,
                                                  limit=limits.MAX_UPLOAD_MB))
    try:
        data = base64.b64decode(payload.translate(_URL_SAFE) + "=" * (-len(payload) % 4), validate=True)
    except binascii.Error:
        return None
    if len(data) > limit_bytes:
        raise UserError(MSG_FILE_TOO_LARGE.format(name=name, size_mb=len(data) / 2**20, limit=limits.MAX_UPLOAD_MB))
    return data or None


class InlineFiles:
    """The files of one tool call: `path_of` turns each argument into a file of the upload folder, and
    `remove` deletes those it decoded once the reply is done (a tool call has no follow-up question)."""

    def __init__(self, upload_folder: str):
        self.upload_folder = upload_folder
        self.real_folder = os.path.realpath(upload_folder)
        self.decoded_folders: list[str] = []

    def path_of(self, value, name: str) -> str:
        """The path of the file `value` holds or names; `name` ("image 2") stands for it in messages and
        names the file it is decoded to."""
        text = value.strip() if isinstance(value, str) else ""
        if text[:5].lower() == "data:":
            data = _base64_bytes(_unwrapped(text[text.index(",") + 1:]), name) if _DATA_URL.match(text) else None
            if data is None:
                raise UserError(MSG_INLINE_NOT_A_FILE.format(name=_shown(text)))
            return self._stored(data, name)
        if _SCHEME.match(text):
            raise UserError(MSG_INLINE_LINK.format(name=_shown(text)))
        if inside_folder(text, self.real_folder):
            return text
        compact = _unwrapped(text)
        data = _base64_bytes(compact, name) if compact else None
        # A JPEG's base64 begins with "/" (its first byte is 0xFF), like a path: one that decodes to no
        # supported file was meant as a path.
        if data is not None and (sniffed_extension(data) is not None or not os.path.isabs(text)):
            return self._stored(data, name)
        if os.path.isabs(text):
            raise UserError(MSG_NOT_AN_UPLOAD.format(name=shown_name(text)))
        raise UserError(MSG_INLINE_NOT_A_FILE.format(name=_shown(text) or name))

    def _stored(self, data: bytes, name: str) -> str:
        """`data` as a new file in the upload folder, named `name` and the extension of its format."""
        extension = sniffed_extension(data)
        if extension is None:
            raise unsupported_file(name)
        folder = os.path.join(self.upload_folder, secrets.token_hex(20))
        os.makedirs(folder)
        self.decoded_folders.append(folder)
        path = os.path.join(folder, name.replace(" ", "-") + extension)
        # Written as a dot-file, which the janitor's size cap spares while it comes in (app.web.uploads).
        partial = os.path.join(folder, "." + os.path.basename(path))
        with open(partial, "wb") as file:
            file.write(data)
        os.replace(partial, path)
        return path

    def remove(self) -> None:
        for folder in self.decoded_folders:
            shutil.rmtree(folder, ignore_errors=True)
        self.decoded_folders.clear()
