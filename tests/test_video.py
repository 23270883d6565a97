"""Video sampling on real files written with OpenCV and decoded by app.media.video."""

import os
import re
import struct

import cv2
import numpy as np
import pytest

from app import limits
from app.errors import UserError
from app.media.video import probe_video, sample_video, sampled_frame_indices
from tests.conftest import frame_index, make_video

VideoCapture = cv2.VideoCapture  # the real one, for the wrappers below while a test replaces it


def patch_avi(path: str, total_frames: int | None = None, size: tuple[int, int] | None = None) -> str:
    """Rewrite an MJPG AVI's header as a lying or hostile file holds it, without encoding a frame: its frame
    count (avih dwTotalFrames, strh dwLength), or its frame size (avih, strf, and every JPEG's SOF0 marker,
    where FFmpeg reads it)."""
    data = bytearray(open(path, "rb").read())
    avih, strh, strf = (data.index(tag) + 8 for tag in (b"avih", b"strh", b"strf"))
    if total_frames:
        struct.pack_into("<I", data, avih + 16, total_frames)
        struct.pack_into("<I", data, strh + 32, total_frames)
    if size:
        struct.pack_into("<II", data, avih + 32, *size)
        struct.pack_into("<ii", data, strf + 4, *size)
        for marker in re.finditer(b"\xff\xc0", data):  # length, precision, then height and width
            struct.pack_into(">HH", data, marker.start() + 5, size[1], size[0])
    with open(path, "wb") as file:
        file.write(data)
    return path


def drop_avi_frames(path: str, keep: list[int]) -> str:
    """Empty the chunks of an MJPG AVI's frames not in `keep`, as capture programs mark dropped frames: the
    header still counts every frame, the others play at irregular times (a variable frame rate), and
    seeking by frame number fails past the last one."""
    data = bytearray(open(path, "rb").read())
    movi = data.index(b"movi")
    end = movi + struct.unpack_from("<I", data, movi - 4)[0]
    index = data.index(b"idx1") + 8  # 16 bytes a frame: chunk id, flags, offset, size
    position, frame = movi + 4, 0
    while position < end:
        tag, size = data[position:position + 4], struct.unpack_from("<I", data, position + 4)[0]
        if tag == b"00dc":
            if frame not in keep:  # an empty chunk, its old bytes left in a JUNK chunk that readers skip
                struct.pack_into("<I4sI", data, position + 4, 0, b"JUNK", size - 8)
                struct.pack_into("<I", data, index + 16 * frame + 12, 0)
            frame += 1
        position += 8 + size + (size & 1)
    with open(path, "wb") as file:
        file.write(data)
    return path


class WrappedCapture:
    """A real capture, some of whose methods a test replaces (a subclass of cv2.VideoCapture crashes Python
    at exit with OpenCV 5.1)."""

    def __init__(self, *args):
        self.capture = VideoCapture(*args)

    def __getattr__(self, name):
        return getattr(self.capture, name)


class UndecodingCapture(WrappedCapture):
    """A capture that fails the test as soon as a frame is decoded."""

    def grab(self):
        raise AssertionError("a frame was decoded")

    read = retrieve = grab


class SmallClaimingCapture(WrappedCapture):
    """A container that says its frames are 32x24, whatever they really are."""

    def get(self, prop):
        claimed = {cv2.CAP_PROP_FRAME_WIDTH: 32, cv2.CAP_PROP_FRAME_HEIGHT: 24}
        return claimed[prop] if prop in claimed else self.capture.get(prop)


class LateLargeCapture(WrappedCapture):
    """From frame 120 on, each frame decoded is a black 400x400 one, unlike the container's size."""

    def read(self, image=None):
        index = int(self.capture.get(cv2.CAP_PROP_POS_FRAMES))
        ok, frame = self.capture.read()
        return ok, np.zeros((400, 400, 3), np.uint8) if index >= 120 else frame


class SeekFailingCapture(WrappedCapture):
    """Seeking and reading a frame fails, as it can in a variable-frame-rate file; reading in order works."""

    def read(self, image=None):
        return False, None


def test_one_frame_per_second_from_the_middle_of_each_second(tmp_path):
    path = make_video(tmp_path, seconds=10, fps=24)
    video = sample_video(path, sample_fps=1.0, max_frames=64)
    assert video.total_frames == 240 and video.native_fps == pytest.approx(24)
    assert video.frame_indices == tuple(12 + 24 * i for i in range(10))
    assert video.frames.shape == (10, 240, 320, 3)
    for frame, index in zip(video.frames, video.frame_indices):
        assert frame_index(frame) == index % 256  # the decoded frame is the one asked for


def test_max_frames_spreads_samples_over_the_whole_video(tmp_path):
    path = make_video(tmp_path, seconds=10, fps=24)
    video = sample_video(path, sample_fps=2.0, max_frames=4)
    assert video.frame_indices == (30, 90, 150, 210)
    assert video.timestamps_s[-1] == pytest.approx(8.75)


def test_sparse_sampling_seeks_and_gets_the_same_frames(tmp_path):
    path = make_video(tmp_path, seconds=40, fps=6)  # 240 frames, 8 wanted: read by seeking
    video = sample_video(path, sample_fps=0.2, max_frames=64)
    assert len(video.frame_indices) == 8
    for frame, index in zip(video.frames, video.frame_indices):
        assert frame_index(frame) == index % 256


@pytest.mark.parametrize("name, fourcc", [("clip.webm", "VP80"), ("clip.avi", "MJPG"), ("clip.mkv", "mp4v"), ("clip.mov", "mp4v")])
def test_other_containers(tmp_path, name, fourcc):
    video = sample_video(make_video(tmp_path, name=name, seconds=3, fps=10, fourcc=fourcc), 1.0, 64)
    assert len(video.frame_indices) == 3


def test_indices_for_a_short_clip_and_a_long_one():
    assert sampled_frame_indices(5, 25.0, 1.0, 64) == [2]  # 0.2 s still yields one frame
    long = sampled_frame_indices(30 * 60 * 30, 30.0, 1.0, 64)  # 30 minutes: capped, uniform
    assert len(long) == 64 and long[0] > 0 and long[-1] < 30 * 60 * 30


def test_a_text_file_named_mp4_is_refused(tmp_path):
    path = tmp_path / "notes.mp4"
    path.write_text("not a video")
    with pytest.raises(UserError, match="could not be decoded|no frames"):
        sample_video(str(path))
    with pytest.raises(UserError):
        probe_video(str(path))


def test_video_tokens_reach_the_model_inputs(manager, tmp_path):
    from app.engine.settings import GenerationSettings
    from app.media.budget import image_token_count

    path = make_video(tmp_path, seconds=5, fps=10, size=(448, 448))
    messages = [{"role": "user", "content": [{"type": "video", "path": path}, {"type": "text", "text": "What happens?"}]}]
    prepared = manager.prepare(messages, GenerationSettings(video_fps=1.0, video_slices_per_frame=1))
    per_frame = image_token_count(manager.processor.video_processor, 448, 448, 1, "16x")
    assert prepared.video_frames == 5
    assert prepared.video_tokens == 5 * per_frame == 5 * 64


def test_frames_one_pixel_high_reach_the_model_as_frames(manager, tmp_path):
    """Handed frames last, transformers' video processor guessed the layout and took a height of 1 (or 3) for the
    channels; told the frames' layout, it reads them as frames of that size, in colour. (OpenCV's writers make
    no 3-pixel-high clip: they round odd heights to even, but for MJPEG's 1.)"""
    from app.engine.settings import GenerationSettings
    from app.media.budget import image_token_count

    path = make_video(tmp_path, "flat.avi", seconds=2, fps=4, size=(64, 1), fourcc="MJPG")
    prepared = manager.prepare([{"role": "user", "content": [{"type": "video", "path": path},
                                                              {"type": "text", "text": "What happens?"}]}],
                               GenerationSettings(video_fps=1.0, video_slices_per_frame=1))
    assert prepared.tensors["pixel_values_videos"].shape[1] == 3  # colour channels
    assert prepared.video_frames == 2
    assert prepared.video_tokens == 2 * image_token_count(manager.processor.video_processor, 1, 64, 1, "16x")


@pytest.mark.parametrize("size, real", [((12000, 12000), False), ((65000, 1000), False), ((8200, 8200), True)])
def test_frames_over_the_pixel_limit_are_refused_before_any_is_decoded(tmp_path, monkeypatch, size, real):
    # A real 8200x8200 frame (0.7 s to write), or a small video whose header and JPEG markers claim the size:
    # a real 12000x12000 AVI of 3 frames takes 9 s to write (and took 10 s and 3.7 GB to sample before).
    # A JPEG's sides stop at 65,535: hence 65000x1000 for a wide one.
    if real:
        path = make_video(tmp_path, "huge.avi", seconds=1, fps=1, size=size, fourcc="MJPG")
    else:
        path = patch_avi(make_video(tmp_path, "huge.avi", seconds=1, fps=4, fourcc="MJPG"), size=size)
    monkeypatch.setattr(cv2, "VideoCapture", UndecodingCapture)
    for read in (probe_video, sample_video):
        with pytest.raises(UserError, match=f"has frames of {size[0]}x{size[1]} pixels, more than 64,000,000"):
            read(path)


@pytest.mark.parametrize("limit, message", [
    ("MAX_IMAGE_PIXELS", "has frames of 320x240 pixels, more than 10,000"),
    ("MAX_VIDEO_SAMPLED_PIXELS", "10 frames of 320x240 pixels from .* more than 10,000 pixels in all"),
])
def test_frames_larger_than_the_container_says_are_refused_as_decoded(tmp_path, monkeypatch, limit, message):
    path = make_video(tmp_path, seconds=10, fps=24)
    monkeypatch.setattr(limits, limit, 10_000)  # the claimed 32x24 frames pass (768 pixels, 7,680 for 10)
    monkeypatch.setattr(cv2, "VideoCapture", SmallClaimingCapture)
    assert probe_video(path) == (240, pytest.approx(24))
    with pytest.raises(UserError, match=message):
        sample_video(path, sample_fps=1.0, max_frames=64)


def test_sampled_frames_are_bounded_in_total_before_decoding(tmp_path, monkeypatch):
    assert 128 * 3840 * 2160 <= limits.MAX_VIDEO_SAMPLED_PIXELS  # a 4K video still gives 128 frames
    path = make_video(tmp_path, seconds=10, fps=24)  # 320x240: 10 frames at 1 fps are 768,000 pixels
    monkeypatch.setattr(limits, "MAX_VIDEO_SAMPLED_PIXELS", 500_000)
    with monkeypatch.context() as undecoding:
        undecoding.setattr(cv2, "VideoCapture", UndecodingCapture)
        with pytest.raises(UserError, match="10 frames of 320x240 .* 500,000 pixels in all. Lower “Max frames”"):
            sample_video(path, sample_fps=1.0, max_frames=64)
    assert len(sample_video(path, sample_fps=1.0, max_frames=6).frames) == 6  # 460,800 pixels


def test_a_header_that_overstates_the_frame_count_gives_the_real_frames_and_says_so(tmp_path):
    path = patch_avi(make_video(tmp_path, "lying.avi", seconds=1, fps=10, fourcc="MJPG"), total_frames=100_000)
    assert probe_video(path) == (100_000, pytest.approx(10))  # 10,000 s: 64 frames planned, all past the end
    video = sample_video(path, sample_fps=10.0, max_frames=64)
    assert video.frame_indices == tuple(range(10)) and video.total_frames == 10
    assert [frame_index(frame) for frame in video.frames] == list(range(10))
    assert video.notices == ("Only 10 of the 64 planned frames of “lying.avi” could be read.",)


def test_frames_that_seeking_misses_in_a_variable_frame_rate_file_are_read_in_order(tmp_path):
    # 40 frames in the header over 4 s; 14 remain, ten in the first second. Seeking finds 1 of the 4 planned
    # (all there was, without a word, before).
    keep = list(range(10)) + [15, 22, 30, 39]
    path = drop_avi_frames(make_video(tmp_path, "dropped.avi", seconds=4, fps=10, fourcc="MJPG"), keep)
    video = sample_video(path, sample_fps=1.0, max_frames=64)
    assert len(video.frame_indices) == 4 and video.total_frames == 14 and video.notices == ()
    assert [frame_index(frame) for frame in video.frames] == [keep[index] for index in video.frame_indices]
    assert video.frame_indices[-1] >= 10  # the samples span the sparse seconds too


def test_reading_in_order_stops_at_the_longest_video_allowed(tmp_path, monkeypatch):
    # 240 frames behind a header that says 48 (2 s at 24 fps), seeking broken: read in order, up to 5 s.
    path = patch_avi(make_video(tmp_path, "long.avi", seconds=10, fps=24, fourcc="MJPG"), total_frames=48)
    monkeypatch.setattr(limits, "MAX_VIDEO_SECONDS", 5)
    monkeypatch.setattr(cv2, "VideoCapture", SeekFailingCapture)
    video = sample_video(path, sample_fps=1.0, max_frames=64)
    assert video.total_frames == 120 and len(video.frame_indices) == 5 and video.frame_indices[-1] < 120
    assert [frame_index(frame) for frame in video.frames] == list(video.frame_indices)


def test_only_a_local_file_reaches_ffmpeg(tmp_path):
    path = make_video(tmp_path, seconds=1, fps=10)
    for name in ("concat:" + path + "|" + path, str(tmp_path)):  # FFmpeg's concat protocol; a folder
        with pytest.raises(UserError):
            probe_video(name)
        with pytest.raises(UserError):
            sample_video(name)


# A copy the browser plays (app.media.playback) --------------------------------------------------------------

def test_frames_shrunk_as_they_are_read_are_the_same_frames(tmp_path):
    """The UI's strip reads the frames the engine reads, each shrunk as it is decoded."""
    path = make_video(tmp_path, seconds=10, fps=24, size=(640, 480))
    whole, shrunk = sample_video(path, 1.0, 64), sample_video(path, 1.0, 64, longest_side=160)
    assert shrunk.frame_indices == whole.frame_indices and shrunk.frames.shape == (10, 120, 160, 3)
    assert [frame_index(frame) for frame in shrunk.frames] == [index % 256 for index in whole.frame_indices]


def test_mp4v_gets_a_vp8_webm_copy_within_its_bounds(tmp_path):
    from app.media.playback import browser_copy, browser_plays, codec

    path = make_video(tmp_path, "phone.mp4", seconds=3, fps=60, size=(1920, 1080))  # mp4v: no browser plays it
    assert codec(path) == "FMP4" and not browser_plays(path, codec(path))
    copy = browser_copy(path)
    assert copy == path + ".browser.webm" and codec(copy) == "VP80" and browser_plays(copy, "VP80")
    capture = VideoCapture(copy)
    width, height = capture.get(cv2.CAP_PROP_FRAME_WIDTH), capture.get(cv2.CAP_PROP_FRAME_HEIGHT)
    fps, frames = capture.get(cv2.CAP_PROP_FPS), capture.get(cv2.CAP_PROP_FRAME_COUNT)
    capture.release()
    assert width * height <= limits.BROWSER_COPY_MAX_PIXELS and width / height == pytest.approx(16 / 9, abs=0.02)
    assert fps == pytest.approx(15) and frames == pytest.approx(45, abs=1)  # every 4th of 60 fps, 3 s
    assert [name for name in os.listdir(tmp_path) if name.startswith(".")] == []  # nothing half-written left


def test_the_copy_stops_at_its_seconds_and_decoded_pixels(tmp_path, monkeypatch):
    from app.media.playback import browser_copy

    path = make_video(tmp_path, "long.mp4", seconds=8, fps=30)

    def copied_frames() -> int:
        capture = VideoCapture(browser_copy(path))
        try:
            return int(capture.get(cv2.CAP_PROP_FRAME_COUNT))
        finally:
            capture.release()
            os.remove(path + ".browser.webm")

    monkeypatch.setattr(limits, "BROWSER_COPY_MAX_SECONDS", 2)
    assert copied_frames() == pytest.approx(2 * 15, abs=1)
    monkeypatch.setattr(limits, "BROWSER_COPY_MAX_DECODED_PIXELS", 320 * 240 * 10)  # ten frames' decoding
    assert copied_frames() <= 5  # every second one of those ten


def test_the_model_reads_the_original_of_a_browser_copy(tmp_path):
    from app.chat import history_to_messages, user_content
    from app.media.files import browser_copy_path, source_of

    original = make_video(tmp_path, "clip.mp4", seconds=1)
    copy = browser_copy_path(original)
    assert source_of(copy) == original and source_of(original) == original
    history = [{"role": "user", "content": {"path": copy}}, {"role": "user", "content": "What happens?"}]
    assert history_to_messages(history)[0]["content"][0] == {"type": "video", "path": original}
    assert user_content("What happens?", [copy])[0] == {"type": "video", "path": original}
    # A file that only looks like a copy (an upload so named, with no original beside it) is itself.
    lone = str(tmp_path / "holiday.mp4.browser.webm")
    open(lone, "wb").close()
    assert source_of(lone) == lone


def test_frames_of_another_size_midway_are_scaled_to_the_first_ones(tmp_path, monkeypatch):
    """A stream can change its size midway: every frame is written, in the first one's size, and the user is told
    (left unwritten, its rows would hold whatever memory the array was given)."""
    path = make_video(tmp_path, seconds=40, fps=6)  # 320x240; frames from 120 on come 400x400
    monkeypatch.setattr(cv2, "VideoCapture", LateLargeCapture)
    for channels_first in (False, True):
        video = sample_video(path, sample_fps=0.5, max_frames=64, channels_first=channels_first)
        frames = video.frames if channels_first else video.frames.transpose(0, 3, 1, 2)
        assert frames.shape == (20, 3, 240, 320)
        late = [index >= 120 for index in video.frame_indices]
        assert any(late) and all((frame == 0).all() == is_late for frame, is_late in zip(frames, late))
        assert video.notices == ("“clip.mp4” changes its frame size midway; its frames were scaled to the first one's size.",)


def test_frames_sampled_channels_first_are_the_frames(tmp_path):
    path = make_video(tmp_path, seconds=10, fps=24)
    rows, columns = sample_video(path, 1.0, 64), sample_video(path, 1.0, 64, channels_first=True)
    assert columns.frames.shape == (10, 3, 240, 320) and columns.frames.flags.c_contiguous
    assert (columns.frames == rows.frames.transpose(0, 3, 1, 2)).all()
