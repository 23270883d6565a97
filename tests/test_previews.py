"""What the model will see, shown before a question is sent: the cut drawn on an image (the processor's),
its cost (prepare_inputs' count), a video's sampled frames (the engine's) and a copy the browser can play."""

import os

import cv2
import numpy as np
import pytest
from PIL import Image

from app import limits
from app.chat import history_to_messages
from app.engine.inputs import prepare_inputs
from app.media.files import source_of
from app.media.playback import browser_plays, codec
from app.media.video import sample_video
from app.ui.pictures import draw_grid, slice_lines, slicing_picture
from app.ui.previews import Previews, ShownVideo, request_images
from tests.conftest import frame_index, make_image, make_video
from tests.test_handlers import ui_settings
from tests.test_hardening import canary, event_index, file_entry, not_uploaded_paths, raw_event  # noqa: F401 (a fixture)

EXAMPLE_VIDEO = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "assets", "examples", "ball.webm")


@pytest.fixture
def previews(manager):
    return Previews(manager)


def chosen(previews, video, video_fps=1.0, video_max_frames=128) -> list:
    """The updates of a video put in a session's player, as the page asks for them."""
    shown = ShownVideo()
    previews.video_put(video, shown)
    return list(previews.video_chosen(video, video_fps, video_max_frames, shown))


def updates(update) -> dict:
    """A gr.update's fields (a skipped output has none)."""
    return {key: value for key, value in update.items() if key != "__type__"}


def line_columns(picture: Image.Image, row: int) -> list[int]:
    """The x of each white pixel (a line's light core) along `row` of a picture of a flat dark image."""
    pixels = np.asarray(picture)[row]
    return [int(x) for x in np.flatnonzero((pixels == 255).all(axis=1))]


@pytest.mark.parametrize("size, slices", [((1344, 1344), 9), ((1920, 1080), 9), ((4000, 1000), 9), ((1000, 3000), 36)], ids=str)
def test_the_grid_drawn_is_the_processors(manager, tmp_path, size, slices):
    """The lines drawn on the picture are where the processor cuts (its grid: tests/test_budget.py checks it
    against the processor's), in equal slices."""
    settings = manager.default_settings().with_overrides({"max_slice_nums": slices,
                                                          "visual_token_budget": limits.MAX_VISUAL_TOKEN_BUDGET})
    slicing = manager.plan_images([make_image(tmp_path, "image.png", size)], settings).images[0]
    picture = draw_grid(Image.new("RGB", (400, 300), (10, 10, 10)), slicing.grid)
    xs, ys = slice_lines(400, 300, slicing.grid)
    assert len(xs) == slicing.grid[1] - 1 and len(ys) == slicing.grid[0] - 1
    assert xs == [round(400 * col / slicing.grid[1]) for col in range(1, slicing.grid[1])]
    between = (ys + [300])[0] // 2  # a row of pixels inside the first row of slices
    assert line_columns(picture, between) == xs
    drawn = np.asarray(picture)
    assert all((drawn[y, 3] == 255).all() for y in ys)


def test_a_small_image_is_its_source_view_alone(manager, tmp_path):
    slicing = manager.plan_images([make_image(tmp_path, "small.png", (448, 448))], manager.default_settings()).images[0]
    assert slicing.grid is None and slicing.tokens == 64
    picture = slicing_picture(Image.new("RGB", (448, 448), (10, 10, 10)), slicing)
    assert picture.width < 448  # one tile, no sliced image beside it


def test_attached_images_show_their_cut_and_the_request_cost_before_sending(previews, manager, tmp_path):
    photo = make_image(tmp_path, "photo.png", (1344, 1344))
    settings = ui_settings(manager)
    pictures, costs = previews.chat_images({"text": "", "files": [photo]}, None, [], settings)
    assert len(pictures["value"]) == 1 and pictures["visible"] and costs["visible"]
    assert "**photo.png**: 640 tokens, source view 448×448 (64) + 3×3 slices of 448×448 (9 × 64)" in costs["value"]
    assert "**640** of 2,560 visual tokens for this request, max 9 slices per image." in costs["value"]
    prepared = prepare_inputs(manager.processor, history_to_messages([{"role": "user", "content": {"path": photo}},
                                                                      {"role": "user", "content": "Hi"}]),
                              manager.default_settings().with_overrides(settings), 32768)
    assert prepared.image_tokens == [640]
    _, one = previews.chat_images({"text": "What is it?", "files": [photo]}, None, [], {**settings, "max_slice_nums": 1})
    assert "64 tokens, source view 448×448 (64)" in one["value"] and "max 1 slice per image" in one["value"]
    gone = previews.chat_images({"text": "", "files": []}, None, [], settings)
    assert not gone[0]["visible"] and not gone[1]["visible"]


def test_the_conversations_earlier_images_share_the_budget(previews, manager, tmp_path):
    earlier = [make_image(tmp_path, f"earlier{i}.png", (1344, 1344)) for i in range(4)]
    history = [{"role": "user", "content": {"path": path}} for path in earlier] + [
        {"role": "user", "content": "Compare them."}, {"role": "assistant", "content": "They look alike."}]
    camera = make_image(tmp_path, "camera.png", (1344, 1344))
    _, costs = previews.chat_images({"text": "", "files": []}, camera, history, ui_settings(manager))
    assert "**camera.png**: 484 tokens" in costs["value"] and "with the conversation's 4 earlier images" in costs["value"]
    assert "lowered from 9 to 7" in costs["value"]
    assert request_images(history * 5, [camera])[-1] == camera and len(request_images(history * 5, [camera])) <= limits.MAX_IMAGES_PER_REQUEST


def test_a_file_that_is_no_image_is_said_before_sending(previews, manager, tmp_path):
    fake = tmp_path / "notimage.png"
    fake.write_text("just some text")
    pictures, costs = previews.chat_images({"files": [str(fake)]}, None, [], ui_settings(manager))
    assert not pictures["visible"] and "could not be read as an image" in costs["value"]


def test_more_images_than_a_request_holds_are_said_before_sending(previews, manager, tmp_path):
    many = [make_image(tmp_path, f"many{i}.png", (64, 64)) for i in range(limits.MAX_IMAGES_PER_REQUEST + 1)]
    told = f"⚠️ {limits.MAX_IMAGES_PER_REQUEST + 1} images in one request; the limit is {limits.MAX_IMAGES_PER_REQUEST}."
    _, costs = previews.chat_images({"files": many}, None, [], ui_settings(manager))
    assert costs["value"].startswith(told)
    assert previews.gallery_images(many, ui_settings(manager))[1].startswith(told)
    assert "⚠️" not in previews.gallery_images(many[:-1], ui_settings(manager))[1]


def test_the_frame_strip_is_the_frames_the_engine_samples(previews, manager, tmp_path):
    video = make_video(tmp_path, "strip.mp4", seconds=6, fps=8)
    info, frames = previews.video_frames(video, 1.0, 128)
    engine = sample_video(video, 1.0, 128)
    shown = frames["value"]
    assert [caption for _, caption in shown] == [f"{t:.1f} s" for t in engine.timestamps_s]
    assert [frame_index(np.asarray(picture)) for picture, _ in shown] == list(engine.frame_indices)
    assert max(shown[0][0].size) <= 256 and "**6** frames will be sampled" in info
    prepared = prepare_inputs(manager.processor, [{"role": "user", "content": [{"type": "video", "path": video},
                                                                              {"type": "text", "text": "What happens?"}]}],
                              manager.default_settings(), 32768)
    assert prepared.video_frames == len(shown)
    fewer = previews.video_frames(video, 1.0, 3)[1]["value"]
    assert [frame_index(np.asarray(picture)) for picture, _ in fewer] == list(sample_video(video, 1.0, 3).frame_indices)


def test_a_video_the_browser_cannot_play_gets_a_webm_copy_the_model_never_reads(previews, manager, tmp_path):
    video = make_video(tmp_path, "phone.mp4", seconds=3, fps=24, size=(1280, 720))  # mp4v
    assert not browser_plays(video, codec(video))
    steps = chosen(previews, video)
    info, frames, chat, note, player = steps[0]
    assert chat == [] and "cannot play this file's video codec (FMP4)" in note["value"] and "**3** frames" in info
    copy = steps[-1][4]
    assert copy == video + ".browser.webm" and codec(copy) == "VP80" and browser_plays(copy, codec(copy))
    capture = cv2.VideoCapture(copy)
    width, height = capture.get(cv2.CAP_PROP_FRAME_WIDTH), capture.get(cv2.CAP_PROP_FRAME_HEIGHT)
    assert width * height <= limits.BROWSER_COPY_MAX_PIXELS and abs(width / height - 16 / 9) < 0.02
    assert capture.get(cv2.CAP_PROP_FPS) <= limits.BROWSER_COPY_MAX_FPS
    capture.release()
    # The copy arriving in the player keeps the conversation, says what it is and shows the original's frames.
    arrived = chosen(previews, copy)
    assert len(arrived) == 1 and updates(arrived[0][2]) == {} and "copy made for the browser" in arrived[0][3]["value"]
    assert [caption for _, caption in arrived[0][1]["value"]] == [caption for _, caption in frames["value"]]
    # Asked about, it is the original the model reads.
    messages = history_to_messages([{"role": "user", "content": {"path": copy}}, {"role": "user", "content": "What happens?"}])
    assert messages[0]["content"][0] == {"type": "video", "path": video} and source_of(copy) == video
    # Made once for an upload: the same file again reuses it.
    assert chosen(previews, video)[-1][4] == copy


def test_a_video_the_browser_plays_is_left_as_it_is(previews):
    steps = chosen(previews, EXAMPLE_VIDEO)
    assert len(steps) == 1 and not steps[0][3]["visible"] and updates(steps[0][4]) == {}
    assert not os.path.exists(EXAMPLE_VIDEO + ".browser.webm")


def test_a_copy_made_for_a_video_replaced_meanwhile_does_not_land(previews, tmp_path):
    """Another video put in the player while the first's copy is made: the first's updates stop there."""
    first, second = make_video(tmp_path, "first.mp4", seconds=2), make_video(tmp_path, "second.mp4", seconds=3)
    shown = ShownVideo()
    previews.video_put(first, shown)
    updates_of_first = previews.video_chosen(first, 1.0, 128, shown)
    assert "being made" in next(updates_of_first)[3]["value"]
    previews.video_put(second, shown)
    assert [[updates(update) for update in step] for step in updates_of_first] == [[{}] * 5]  # no copy over the second
    assert chosen(previews, second)[-1][4].endswith("second.mp4.browser.webm")


def test_a_forged_path_never_reaches_the_previews(server_url, canary, tmp_path, manager):
    """The Video tab's preview event (it opens the video in the web process) and the Multi-image one, called
    with a URL, a protocol or a file of the server: refused before anything is opened or fetched."""
    from app.ui.handlers import SETTING_KEYS

    settings = [manager.default_settings().as_dict()[key] for key in SETTING_KEYS]
    video_chosen, gallery_images = event_index(server_url, "video_chosen"), event_index(server_url, "gallery_images")
    for path in not_uploaded_paths(canary, tmp_path)[:7]:
        for event, data in ((video_chosen, [file_entry(path, False), 1.0, 128, None]),
                            (gallery_images, [[{"image": file_entry(path, False), "caption": None}], *settings])):
            answer = raw_event(server_url, event, data)
            assert not answer["success"] and "was not uploaded to this app" in answer["output"]["error"], (path, answer)
    assert canary["requests"] == []
