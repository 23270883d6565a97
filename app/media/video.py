"""Decoding a video with OpenCV and sampling frames uniformly in time, without decoding it whole."""

import os
from dataclasses import dataclass

import cv2
import numpy as np

from app import limits
from app.errors import UserError

# Below this ratio of wanted to total frames, seeking to each frame beats decoding every frame in order.
_SEQUENTIAL_READ_RATIO = 0.25


@dataclass(frozen=True)
class SampledVideo:
    frames: np.ndarray  # (frames, height, width, 3) uint8 RGB
    frame_indices: tuple[int, ...]
    native_fps: float
    total_frames: int

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


def _read_sequentially(capture, wanted: list[int]) -> dict[int, np.ndarray]:
    frames = {}
    wanted_set = set(wanted)
    last = wanted[-1]
    index = 0
    while index <= last and capture.grab():
        if index in wanted_set:
            ok, frame = capture.retrieve()
            if ok:
                frames[index] = frame
        index += 1
    return frames


def _read_by_seeking(capture, wanted: list[int]) -> dict[int, np.ndarray]:
    frames = {}
    for index in wanted:
        capture.set(cv2.CAP_PROP_POS_FRAMES, index)
        ok, frame = capture.read()
        if ok:
            frames[index] = frame
    return frames


def probe_video(path: str) -> tuple[int, float]:
    """(frame count, frames per second) from the container header; raises UserError if unusable."""
    capture = cv2.VideoCapture(path)
    try:
        return _probe(capture, os.path.basename(path))
    finally:
        capture.release()


def _probe(capture, name: str) -> tuple[int, float]:
    if not capture.isOpened():
        raise UserError(limits.MSG_UNREADABLE_VIDEO.format(name=name))
    total_frames = int(capture.get(cv2.CAP_PROP_FRAME_COUNT))
    native_fps = float(capture.get(cv2.CAP_PROP_FPS))
    if total_frames <= 0:
        raise UserError(limits.MSG_EMPTY_VIDEO.format(name=name))
    if not native_fps > 0:
        raise UserError(limits.MSG_UNREADABLE_VIDEO.format(name=name))
    if total_frames / native_fps > limits.MAX_VIDEO_SECONDS:
        raise UserError(limits.MSG_VIDEO_TOO_LONG.format(name=name, seconds=total_frames / native_fps,
                                                         limit=limits.MAX_VIDEO_SECONDS))
    return total_frames, native_fps


def sample_video(path: str, sample_fps: float = limits.DEFAULT_VIDEO_FPS,
                 max_frames: int = limits.DEFAULT_VIDEO_MAX_FRAMES) -> SampledVideo:
    name = os.path.basename(path)
    capture = cv2.VideoCapture(path)
    try:
        total_frames, native_fps = _probe(capture, name)
        wanted = sampled_frame_indices(total_frames, native_fps, sample_fps, max_frames)
        if len(wanted) >= _SEQUENTIAL_READ_RATIO * total_frames:
            decoded = _read_sequentially(capture, wanted)
        else:
            decoded = _read_by_seeking(capture, wanted)
    finally:
        capture.release()
    if not decoded:
        raise UserError(limits.MSG_EMPTY_VIDEO.format(name=name))
    indices = sorted(decoded)
    frames = np.stack([cv2.cvtColor(decoded[i], cv2.COLOR_BGR2RGB) for i in indices])
    return SampledVideo(frames=frames, frame_indices=tuple(indices), native_fps=native_fps, total_frames=total_frames)
