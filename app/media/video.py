"""Decoding a video with OpenCV and sampling frames uniformly in time, without decoding it whole."""

import os
from contextlib import contextmanager
from dataclasses import dataclass

import cv2
import numpy as np

from app import limits, tuning
from app.messages import (
    MSG_EMPTY_VIDEO,
    MSG_UNREADABLE_VIDEO,
    MSG_VIDEO_FRAMES_MISSING,
    MSG_VIDEO_FRAME_SIZES,
    MSG_VIDEO_FRAME_TOO_LARGE,
    MSG_VIDEO_SAMPLED_TOO_LARGE,
    MSG_VIDEO_TOO_LONG,
)
from app.errors import UserError
from app.media.files import check_local_file
from app.media.images import check_shape

# Below this ratio of wanted to total frames, seeking to each frame beats decoding every frame in order.
_SEQUENTIAL_READ_RATIO = 0.25


@dataclass(frozen=True)
class SampledVideo:
    frames: np.ndarray  # (frames, height, width, 3) uint8 RGB; (frames, 3, height, width) if sampled channels first
    frame_indices: tuple[int, ...]
    native_fps: float
    total_frames: int
    notices: tuple[str, ...] = ()  # for the user: fewer frames read than planned, frames scaled to one size

    @property
    def timestamps_s(self) -> tuple[float, ...]:
        return tuple(index / self.native_fps for index in self.frame_indices)


def sampled_frame_indices(total_frames: int, native_fps: float, sample_fps: float, max_frames: int) -> list[int]:
    """Frame indices at sample_fps (at least one), spread evenly over the whole video when capped at max_frames."""
    duration = total_frames / native_fps
    count = max(1, min(max_frames, round(duration * sample_fps), total_frames))
    step = total_frames / count
    # The middle of each of `count` equal spans: uniform, and never the black first/last frame only.
    return sorted({min(total_frames - 1, int((i + 0.5) * step)) for i in range(count)})


@contextmanager
def _opened(path: str):
    """The file through OpenCV's FFmpeg backend only: OpenCV's other backends interpret the name (the
    image-sequence one reads "%d" patterns), and only a local file's path is handed over. Decoded with
    tuning.VIDEO_DECODE_THREADS threads."""
    check_local_file(path)
    capture = cv2.VideoCapture(path, cv2.CAP_FFMPEG, [cv2.CAP_PROP_N_THREADS, tuning.VIDEO_DECODE_THREADS])
    try:
        yield capture
    finally:
        capture.release()


def _check_frame_size(name: str, width: int, height: int, frames: int = 1) -> None:
    """Refuse frames over the image pixel limit, or `frames` of them over the sampled-pixel limit. Run on the
    header's size before any frame is decoded, and on each decoded frame, since a container may lie."""
    if width * height > limits.MAX_IMAGE_PIXELS:
        raise UserError(MSG_VIDEO_FRAME_TOO_LARGE.format(name=name, width=width, height=height,
                                                                limit=limits.MAX_IMAGE_PIXELS))
    if frames * width * height > limits.MAX_VIDEO_SAMPLED_PIXELS:
        raise UserError(MSG_VIDEO_SAMPLED_TOO_LARGE.format(name=name, frames=frames, width=width, height=height,
                                                                  limit=limits.MAX_VIDEO_SAMPLED_PIXELS))


def _read_sequentially(capture, wanted: list[int]):
    """(index, frame) of each wanted frame, decoding every frame up to the last one (grab() decodes)."""
    wanted_set = set(wanted)
    index = 0
    while index <= wanted[-1] and capture.grab():
        if index in wanted_set:
            ok, frame = capture.retrieve()
            if ok:
                yield index, frame
        index += 1


def _read_by_seeking(capture, wanted: list[int]):
    for index in wanted:
        capture.set(cv2.CAP_PROP_POS_FRAMES, index)
        ok, frame = capture.read()
        if ok:
            yield index, frame


def _checked(frames, name: str, planned: int, longest_side: int | None) -> dict[int, np.ndarray]:
    """{index: frame}, each frame held to the size limits as it comes (a container may understate its
    size), then shrunk to at most `longest_side` pixels a side if that is set."""
    decoded = {}
    for index, frame in frames:
        height, width = frame.shape[:2]
        _check_frame_size(name, width, height, planned)
        if longest_side is not None and max(height, width) > longest_side:
            scale = longest_side / max(height, width)
            frame = cv2.resize(frame, (max(1, round(width * scale)), max(1, round(height * scale))),
                               interpolation=cv2.INTER_AREA)
        decoded[index] = frame
    return decoded


def probe_video(path: str) -> tuple[int, float]:
    """(frame count, frames per second) from the container header, decoding no frame; raises UserError if
    unusable, frames over the pixel limit included."""
    with _opened(path) as capture:
        return _probe(capture, os.path.basename(path))[:2]


def planned_frames(path: str, sample_fps: float, max_frames: int) -> tuple[int, int, int]:
    """(frames, height, width) that sample_video gives if the container header holds, decoding no frame: what a
    video that a kept conversation holds is matched by (app.engine.held_videos). Raises UserError as
    sample_video does for what the header shows."""
    with _opened(path) as capture:
        _, _, width, height, wanted = _planned(capture, os.path.basename(path), sample_fps, max_frames)
    return len(wanted), height, width


def _planned(capture, name: str, sample_fps: float, max_frames: int) -> tuple[int, float, int, int, list[int]]:
    """(frame count, frames per second, width, height, the frame indices to sample) from the container header,
    the frames held to the size limits: sample_video's plan, and planned_frames'."""
    total_frames, native_fps, width, height = _probe(capture, name)
    wanted = sampled_frame_indices(total_frames, native_fps, sample_fps, max_frames)
    _check_frame_size(name, width, height, len(wanted))
    return total_frames, native_fps, width, height, wanted


def _probe(capture, name: str) -> tuple[int, float, int, int]:
    """(frame count, frames per second, width, height) from the container header."""
    if not capture.isOpened():
        raise UserError(MSG_UNREADABLE_VIDEO.format(name=name))
    width, height = int(capture.get(cv2.CAP_PROP_FRAME_WIDTH)), int(capture.get(cv2.CAP_PROP_FRAME_HEIGHT))
    _check_frame_size(name, width, height)
    check_shape(name, width, height)
    total_frames = int(capture.get(cv2.CAP_PROP_FRAME_COUNT))
    native_fps = float(capture.get(cv2.CAP_PROP_FPS))
    if total_frames <= 0:
        raise UserError(MSG_EMPTY_VIDEO.format(name=name))
    if not native_fps > 0:
        raise UserError(MSG_UNREADABLE_VIDEO.format(name=name))
    if total_frames / native_fps > limits.MAX_VIDEO_SECONDS:
        raise UserError(MSG_VIDEO_TOO_LONG.format(name=name, seconds=total_frames / native_fps,
                                                         limit=limits.MAX_VIDEO_SECONDS))
    return total_frames, native_fps, width, height


def _count_frames(path: str, name: str, native_fps: float) -> tuple[int, float]:
    """(frames, average frames per second) of what the file really holds, from its packets: nothing is
    decoded, and no more than MAX_VIDEO_SECONDS at the header's rate is read."""
    count, last_s = 0, 0.0
    with _opened(path) as capture:
        capture.set(cv2.CAP_PROP_FORMAT, -1)  # OpenCV's raw mode: grab() reads a packet, decoding nothing
        while count < limits.MAX_VIDEO_SECONDS * native_fps and capture.grab():
            count += 1
            last_s = max(last_s, capture.get(cv2.CAP_PROP_POS_MSEC) / 1000)
    if not count:
        raise UserError(MSG_EMPTY_VIDEO.format(name=name))
    # A variable frame rate's header gives its highest rate, and some files carry no timestamps: the longer
    # of the two durations.
    return count, count / max(last_s + 1 / native_fps, count / native_fps)


def sample_video(path: str, sample_fps: float = limits.DEFAULT_VIDEO_FPS,
                 max_frames: int = limits.DEFAULT_VIDEO_MAX_FRAMES, longest_side: int | None = None,
                 channels_first: bool = False) -> SampledVideo:
    """Frames at sample_fps, at most max_frames, from what the file really holds. A long video is read by
    seeking to each frame; when that finds fewer than planned (a header that overstates the frame count, or
    seeking that misses in a variable-frame-rate file), the frames are counted and read in order instead.
    With `longest_side` each frame is shrunk to that as it is decoded (the UI's strip of the frames the
    model is shown: the same frames, by the same reading). `channels_first`: as the video processor takes
    them (app.engine.inputs)."""
    name = os.path.basename(path)
    with _opened(path) as capture:
        total_frames, native_fps, _, _, wanted = _planned(capture, name, sample_fps, max_frames)
        read = _read_sequentially if len(wanted) >= _SEQUENTIAL_READ_RATIO * total_frames else _read_by_seeking
        decoded = _checked(read(capture, wanted), name, len(wanted), longest_side)
    notices = ()
    if len(decoded) < len(wanted):
        planned = len(wanted)
        total_frames, native_fps = _count_frames(path, name, native_fps)
        wanted = sampled_frame_indices(total_frames, native_fps, sample_fps, max_frames)
        with _opened(path) as capture:
            decoded = _checked(_read_sequentially(capture, wanted), name, len(wanted), longest_side)
        if len(decoded) < planned:
            notices = (MSG_VIDEO_FRAMES_MISSING.format(read=len(decoded), planned=planned, name=name),)
    if not decoded:
        raise UserError(MSG_EMPTY_VIDEO.format(name=name))
    indices = sorted(decoded)
    frames, scaled = _rgb_frames(decoded, indices, channels_first)
    if scaled:
        notices += (MSG_VIDEO_FRAME_SIZES.format(name=name),)
    return SampledVideo(frames=frames, frame_indices=tuple(indices), native_fps=native_fps,
                        total_frames=total_frames, notices=notices)


def _rgb_frames(decoded: dict[int, np.ndarray], indices: list[int],
                channels_first: bool) -> tuple[np.ndarray, bool]:
    """The decoded BGR frames in RGB, one array in the first frame's size, each frame freed as it is copied in (no
    third copy); and whether any was scaled to that size: a stream can change its size midway, and every row of the
    array must be written, or memory a request left behind would reach the model. Channels first, the copy also
    lays them out as the video processor takes them: one strided copy, where converting the colours and then
    moving the channels made two (0.17 s for 16 frames of 1080p on a core, against 0.04; docs/DECISIONS.md D71)."""
    height, width = decoded[indices[0]].shape[:2]
    shape = (len(indices), 3, height, width) if channels_first else (len(indices), height, width, 3)
    frames = np.empty(shape, np.uint8)
    scaled = False
    for frame, index in zip(frames, indices):
        bgr = decoded.pop(index)
        if bgr.shape[:2] != (height, width):
            bgr, scaled = cv2.resize(bgr, (width, height), interpolation=cv2.INTER_AREA), True
        # Anything but 3 channels of uint8 raises: no row is left unwritten.
        np.copyto(frame, bgr.transpose(2, 0, 1)[::-1] if channels_first else bgr[..., ::-1], casting="no")
    return frames, scaled
