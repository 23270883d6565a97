"""Video sampling on real files written with OpenCV and decoded by app.media.video."""

import pytest

from app.errors import UserError
from app.media.video import probe_video, sample_video, sampled_frame_indices
from tests.conftest import frame_index, make_video


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
