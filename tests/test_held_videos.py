"""A video that a kept conversation holds is not sampled again (app.engine.held_videos): a follow-up about it
gets the same prompt tokens and, greedy, the same reply, token for token, as one whose video is decoded."""

import copy

import numpy as np
import pytest

from app.engine.held_videos import PlannedFrames
from app.engine.settings import GenerationSettings
from tests.conftest import make_video
from tests.test_conversations import (  # noqa: F401 (cache: a fixture)
    GREEDY, cache, conversation, reply, same_with_and_without, text)
from tests.test_video import patch_avi


@pytest.fixture
def sampled(monkeypatch):
    """The paths of the videos the preparer samples, one for each time."""
    from app.engine import inputs

    paths = []
    sample = inputs.sample_video
    monkeypatch.setattr(inputs, "sample_video",
                        lambda path, *rest, **named: paths.append(path) or sample(path, *rest, **named))
    return paths


@pytest.mark.parametrize("size", [(360, 640), (720, 1280), (1000, 300), (80, 100), (2160, 3840)])
def test_the_planned_frames_give_the_processors_tokens_and_sizes(manager, size):
    processor = manager.processor
    assert PlannedFrames.plans(processor.video_processor)
    frames = np.random.default_rng(0).integers(0, 256, (3, *size, 3), dtype=np.uint8)
    for slices, mode in ((1, "16x"), (2, "4x"), (9, "16x")):
        arguments = dict(text=["<|video_pad|> What happens?"], use_image_id=False, return_tensors="pt",
                         videos_kwargs={"max_slice_nums": slices, "downsample_mode": mode, "do_sample_frames": False})
        decoded = processor(videos=[frames], **arguments)
        planned_processor = copy.copy(processor)
        planned_processor.video_processor = PlannedFrames(processor.video_processor, (3, *size))
        planned = planned_processor(videos=[planned_processor.video_processor.stand_in()], **arguments)
        assert planned["input_ids"].equal(decoded["input_ids"])
        assert planned["target_sizes_videos"].equal(decoded["target_sizes_videos"])
        assert "pixel_values_videos" not in planned


def test_a_follow_up_about_a_short_video_samples_it_once(manager, cache, sampled, tmp_path):
    """A two-second clip's prompt is far shorter than the app's threshold for keeping a conversation, and is kept
    all the same: otherwise each follow-up would sample its frames again."""
    video = make_video(tmp_path, seconds=2, fps=8)
    first = [{"type": "video", "path": video}, text("What happens?")]
    cache(2**30, min_tokens=512)
    kept = conversation(manager, first, [[text("And then?")], [text("Why?")]])
    assert kept[0][1] < 512 and all(reused > 0 for _, _, reused in kept[1:])
    assert sampled == [video]
    sampled.clear()
    cache(0)
    assert [turn[0] for turn in conversation(manager, first, [[text("And then?")], [text("Why?")]])] == \
        [turn[0] for turn in kept]
    assert sampled == [video] * 3


def test_a_video_in_a_later_turn_and_thinking(manager, cache, sampled, tmp_path):
    video = make_video(tmp_path, seconds=3, fps=8, size=(400, 240))
    thinking = GenerationSettings(max_new_tokens=12, do_sample=False, enable_thinking=True)
    turns = same_with_and_without(manager, cache, [text("I will send a clip.")],
                                  [[{"type": "video", "path": video}, text("What happens?")], [text("And then?")]],
                                  settings=thinking)
    assert turns[1][1] - 20 < turns[2][2] < turns[1][1]  # all but the video turn's generation prompt reused
    assert sampled.count(video) == 1 + 2  # with the cache once; without, each turn that holds it


def test_a_header_that_overstates_the_frames_plans_no_held_video(manager, cache, sampled, tmp_path, monkeypatch):
    """The header says 400 frames (40 s, 40 to sample), the file holds 40 (4 s): the first sampling reads 4 frames
    and says so. A follow-up's planned 40 frames match no kept video, so no stand-in is made: it is sampled."""
    from app.engine import held_videos

    video = patch_avi(make_video(tmp_path, "lying.avi", seconds=4, fps=10, fourcc="MJPG"), total_frames=400)
    stand_ins = []

    class Recorded(held_videos.PlannedFrames):
        def __init__(self, *arguments):
            stand_ins.append(arguments)
            super().__init__(*arguments)

    monkeypatch.setattr(held_videos, "PlannedFrames", Recorded)
    turns = same_with_and_without(manager, cache, [{"type": "video", "path": video}, text("What happens?")],
                                  [[text("And then?")]])
    assert turns[1][2] > 0  # its kept state is still gone on from
    assert sampled.count(video) == 2 + 2 and stand_ins == []
    first = reply(manager, [{"role": "user", "content": [{"type": "video", "path": video}, text("What?")]}])
    assert "Only 4 of the 40 planned frames" in " ".join(first.notices)


def test_the_last_questions_video_is_never_held(manager, tmp_path):
    """Even where the preparer were told that a kept conversation holds it (app.engine.held_videos checks too)."""
    from app.engine.conversations import video_key
    from app.engine.held_videos import held_video
    from app.media.video import planned_frames

    video = make_video(tmp_path, seconds=2, fps=8)
    key = video_key(video, planned_frames(video, GREEDY.video_fps, GREEDY.video_max_frames), GREEDY)
    question = {"role": "user", "content": [{"type": "video", "path": video}, text("What happens?")]}
    follow_up = [question, {"role": "assistant", "content": [text("A clip.")]},
                 {"role": "user", "content": [text("And then?")]}]
    assert held_video(manager.processor, [question], video, GREEDY, frozenset({key})) is None
    assert held_video(manager.processor, follow_up, video, GREEDY, frozenset({key})) is not None
    assert held_video(manager.processor, follow_up, video, GREEDY, frozenset()) is None


def test_a_video_let_go_while_its_follow_up_is_prepared_is_sampled_again(manager, cache, sampled, tmp_path):
    video = make_video(tmp_path, seconds=2, fps=8)
    first = [{"type": "video", "path": video}, text("What happens?")]
    kept = cache(2**30)
    answer = conversation(manager, first, [])[0][0]
    follow_up = [{"role": "user", "content": first}, {"role": "assistant", "content": [text(answer)]},
                 {"role": "user", "content": [text("And then?")]}]
    kept.find = lambda prepared: None  # held when the preparer was told, gone when it is looked for
    prepared = manager.prepare(follow_up, GREEDY)
    assert not prepared.pixels_left_out and prepared.tensors["pixel_values_videos"] is not None
    update = reply(manager, follow_up)
    cache(0)
    assert update.text == reply(manager, follow_up).text and update.stats["reused_prompt_tokens"] == 0


def test_the_last_questions_video_is_always_sampled(manager, cache, sampled, tmp_path):
    """Even where another conversation holds that very file: its preparation's time would tell so."""
    video = make_video(tmp_path, seconds=2, fps=8)
    cache(2**30)
    conversation(manager, [{"type": "video", "path": video}, text("What happens?")], [])
    reply(manager, [{"role": "user", "content": [{"type": "video", "path": video}, text("Describe it.")]}])
    assert sampled == [video, video]
