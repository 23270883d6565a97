"""A video's copy for the browser's player, for display only: the model reads the original.

Chromium plays H.264, VP8, VP9 and AV1; OpenCV and phone editors often write MPEG-4 Part 2 ("mp4v"), which
Gradio's player shows as "Video not playable". Such a video gets a VP8 WebM copy beside it, named after it
(app.media.files.browser_copy_path), made within the bounds in app.limits. It lies among the uploads, so
the upload janitor (app.web.uploads) expires and caps it with them.
"""

import math
import os
import tempfile

import cv2

from app import limits
from app.media.files import browser_copy_path
from app.media.video import probe_video

# The codecs Chromium plays, by container (OpenCV's FOURCC of the video stream, in upper case).
_PLAYABLE = {
    ".mp4": {"AVC1", "H264", "AV01", "VP09"},
    ".mov": {"AVC1", "H264"},
    ".webm": {"VP80", "VP90", "AV01"},
}


def codec(path: str) -> str:
    """The video stream's FOURCC as OpenCV reads it from the header (FMP4 for mp4v, AVC1 for H.264...)."""
    probe_video(path)  # a local file, and one the engine would take
    capture = cv2.VideoCapture(path, cv2.CAP_FFMPEG)
    try:
        code = int(capture.get(cv2.CAP_PROP_FOURCC))
    finally:
        capture.release()
    return "".join(char for char in code.to_bytes(4, "little").decode("latin-1") if char.isalnum()).upper()


def browser_plays(path: str, video_codec: str) -> bool:
    """Whether Chromium plays a file of this name whose video stream has this codec (`codec`)."""
    return video_codec in _PLAYABLE.get(os.path.splitext(path)[1].lower(), ())


def copy_size(width: int, height: int) -> tuple[int, int]:
    """(width, height) of the copy's frames: at most BROWSER_COPY_MAX_PIXELS, the shape kept, even sides."""
    scale = min(1.0, math.sqrt(limits.BROWSER_COPY_MAX_PIXELS / (width * height)))
    return max(2, round(width * scale / 2) * 2), max(2, round(height * scale / 2) * 2)


def write_browser_copy(path: str, copy: str) -> bool:
    """Write a VP8 WebM copy of `path` to `copy` (whole, or not at all: it is written under a hidden name
    and renamed); False if this OpenCV cannot write one or no frame could be read."""
    total_frames, fps = probe_video(path)
    folder = os.path.dirname(copy)
    handle, partial = tempfile.mkstemp(prefix=".", suffix=".webm", dir=folder)  # the janitor never evicts dot-files
    os.close(handle)
    capture = cv2.VideoCapture(path, cv2.CAP_FFMPEG)
    try:
        width, height = int(capture.get(cv2.CAP_PROP_FRAME_WIDTH)), int(capture.get(cv2.CAP_PROP_FRAME_HEIGHT))
        step = max(1, math.ceil(fps / limits.BROWSER_COPY_MAX_FPS))
        size = copy_size(width, height)
        writer = cv2.VideoWriter(partial, cv2.VideoWriter_fourcc(*"VP80"), fps / step, size)
        try:
            written = writer.isOpened() and _copy_frames(capture, writer, size, step, total_frames, fps, width * height)
        finally:
            writer.release()
    finally:
        capture.release()
    if not written:
        os.remove(partial)
        return False
    os.replace(partial, copy)
    return True


def _copy_frames(capture, writer, size: tuple[int, int], step: int, total_frames: int, fps: float,
                 frame_pixels: int) -> int:
    """Every `step`-th frame, resized, into `writer`, within the copy's bounds; the frames written."""
    last = min(total_frames, limits.BROWSER_COPY_MAX_SECONDS * fps)
    decoded_pixels, written, index = 0, 0, 0
    # grab() decodes every frame, kept or not: the decoding is what the pixel bound counts.
    while index < last and decoded_pixels < limits.BROWSER_COPY_MAX_DECODED_PIXELS and capture.grab():
        if index % step == 0:
            ok, frame = capture.retrieve()
            if ok:
                frame_pixels = frame.shape[0] * frame.shape[1]  # a container may understate its frames
                writer.write(cv2.resize(frame, size, interpolation=cv2.INTER_AREA))
                written += 1
        decoded_pixels += frame_pixels
        index += 1
    return written


def browser_copy(path: str) -> str | None:
    """A copy of `path` the browser plays, made now or earlier (for the same upload); None if none could be made."""
    copy = browser_copy_path(path)
    if os.path.exists(copy):
        os.utime(copy)  # in use again: the janitor's age counts from now
        return copy
    return copy if write_browser_copy(path, copy) else None
