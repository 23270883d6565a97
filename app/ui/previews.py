"""What the model will see, shown before a question is sent: each attached image with the cut the processor
will make and its visual tokens (planned by the engine, manager.plan_images: no processor here), and a
video's sampled frames with their times, in a player the browser can play (app.media.playback)."""

import functools
import os

import gradio as gr
from PIL import Image

from app import limits
from app.messages import (
    MSG_MULTI_IMAGE_HINT,
    MSG_TOO_MANY_IMAGES,
    MSG_UPLOAD_GONE,
    MSG_VIDEO_BROWSER_COPY,
    MSG_VIDEO_HINT,
    MSG_VIDEO_NO_BROWSER_COPY,
    MSG_VIDEO_NOT_PLAYABLE,
    MSG_VIDEO_SAMPLING,
)
from app.chat import history_to_messages
from app.errors import UserError
from app.media.budget import ImageSlicing, SlicePlan
from app.media.files import shown_name, source_of
from app.media.images import load_thumbnail
from app.media.playback import browser_copy, browser_plays, codec
from app.media.video import sample_video
from app.ui.handlers import upload_path
from app.ui.pictures import FRAME_SIDE, SLICED_SIDE, clock, slicing_picture

HIDDEN = {"value": None, "visible": False}


def _note(text: str | None):
    """The note under the video player: what it shows, when that is not the file itself."""
    return gr.update(**HIDDEN) if text is None else gr.update(value=text, visible=True)


def _skipped() -> tuple:
    """video_chosen's update that changes nothing."""
    return tuple(gr.skip() for _ in range(5))


def _copy_shown() -> str:
    return MSG_VIDEO_BROWSER_COPY.format(seconds=limits.BROWSER_COPY_MAX_SECONDS, fps=limits.BROWSER_COPY_MAX_FPS)


def _size(size: tuple[int, int]) -> str:
    """A (height, width) size, or a (rows, cols) grid, the way round people say it: across, then down."""
    height, width = size
    return f"{width}×{height}"


def seen_as(slicing: ImageSlicing) -> str:
    """How the model sees an image, and what each part costs."""
    source = f"source view {_size(slicing.source)} ({slicing.source_tokens})"
    if slicing.grid is None:
        return source
    return f"{source} + {_size(slicing.grid)} slices of {_size(slicing.slice_size)} ({slicing.slice_count} × {slicing.slice_tokens})"


def _slices(count: int) -> str:
    return f"{count} slice" if count == 1 else f"{count} slices"


def cost_list(paths: list[str], slicings: tuple[ImageSlicing, ...]) -> str:
    return "\n".join(f"{i + 1}. **{os.path.basename(path)}**: {slicing.tokens:,} tokens, {seen_as(slicing)}"
                     for i, (path, slicing) in enumerate(zip(paths, slicings)))


def plan_summary(plan: SlicePlan, earlier: int = 0) -> str:
    """The request's total against its budget; `earlier`: the conversation's images it also carries."""
    carried = f" (with the conversation's {earlier} earlier image{'s' if earlier > 1 else ''})" if earlier else ""
    return (f"**{plan.total_tokens:,}** of {plan.budget:,} visual tokens for this request{carried}, "
            f"max {_slices(plan.max_slice_nums)} per image.")


def request_images(history: list | None, attached: list[str]) -> list[str]:
    """The images a question with `attached` would carry: the conversation's, then these, the oldest turns
    left out past MAX_IMAGES_PER_REQUEST as the engine leaves them out (app.engine.inputs)."""
    turns = [[part["path"] for part in message["content"] if part["type"] == "image"]
             for message in history_to_messages(history or []) if message["role"] == "user"]
    turns.append(list(attached))
    while len(turns) > 1 and sum(map(len, turns)) > limits.MAX_IMAGES_PER_REQUEST:
        turns.pop(0)
    return [path for turn in turns for path in turn]


@functools.lru_cache(maxsize=32)
def _thumbnail(path: str, modified: float) -> Image.Image:
    """Decoded once per upload (`modified` tells a file replaced under its name): the slider moves redraw it."""
    return load_thumbnail(path, SLICED_SIDE)


def _pictures(paths: list[str], slicings: tuple[ImageSlicing, ...]) -> list[tuple[Image.Image, str]]:
    pictures = []
    for path, slicing in zip(paths, slicings):
        try:
            modified = os.path.getmtime(path)
        except OSError:  # expired since the engine planned it
            raise UserError(MSG_UPLOAD_GONE.format(name=shown_name(path))) from None
        pictures.append((slicing_picture(_thumbnail(path, modified), slicing),
                         f"{os.path.basename(path)} · {slicing.tokens:,} tokens"))
    return pictures


def _too_many(paths: list[str]) -> str | None:
    """Said before sending: more images than one request holds are refused when sent."""
    if len(paths) > limits.MAX_IMAGES_PER_REQUEST:
        return "⚠️ " + MSG_TOO_MANY_IMAGES.format(count=len(paths), limit=limits.MAX_IMAGES_PER_REQUEST)
    return None


class ShownVideo:
    """Which video a session's player holds (a gr.State's value: one per session, the same object in each of
    its events), so that a browser copy made for an earlier one does not land over it."""

    def __init__(self):
        self.source: str | None = None


class Previews:
    def __init__(self, manager):
        self.manager = manager

    def _plan(self, paths: list[str], settings: dict) -> SlicePlan:
        return self.manager.plan_images(paths, self.manager.default_settings().with_overrides(settings))

    # Images --------------------------------------------------------------------------------------------

    def chat_images(self, message: dict | None, camera: str | None, history: list, settings: dict):
        """The Chat box's attachments (and the camera's photo) as the model will see them with the
        conversation's earlier images: (pictures, costs)."""
        attached = [upload_path(file) for file in (message or {}).get("files") or []] + ([camera] if camera else [])
        if not attached:
            return gr.update(**HIDDEN), gr.update(**HIDDEN)
        paths = request_images(history, attached)
        try:
            plan = self._plan(paths, settings)
            new = plan.images[-len(attached):]
            pictures = _pictures(attached, new)
        except UserError as error:
            return gr.update(**HIDDEN), gr.update(value=f"⚠️ {error}", visible=True)
        text = "\n\n".join(filter(None, [_too_many(attached), cost_list(attached, new),
                                         plan_summary(plan, len(paths) - len(attached)), plan.notice()]))
        return gr.update(value=pictures, visible=True), gr.update(value=text, visible=True)

    def gallery_images(self, gallery: list | None, settings: dict | None = None):
        """The Multi-image gallery as the model will see it: (pictures, costs)."""
        paths = [upload_path(item) for item in gallery or []]
        if not paths:
            return gr.update(**HIDDEN), MSG_MULTI_IMAGE_HINT
        try:
            plan = self._plan(paths, settings or {})
            pictures = _pictures(paths, plan.images)
        except UserError as error:
            return gr.update(**HIDDEN), f"⚠️ {error}"
        text = "\n\n".join(filter(None, [_too_many(paths), cost_list(paths, plan.images), plan_summary(plan),
                                         plan.notice()]))
        return gr.update(value=pictures, visible=True), text

    # Video ---------------------------------------------------------------------------------------------

    @staticmethod
    def video_put(video: str | None, shown: ShownVideo) -> None:
        """Note the video a session's player now holds (as soon as it does: not queued behind other previews)."""
        shown.source = source_of(video) if video else None

    def video_chosen(self, video: str | None, video_fps: float, video_max_frames: int, shown: ShownVideo):
        """A video put in the player, as updates of (the sampling, the frames, the conversation, the player's
        note, the player). A new video starts a new conversation (its browser copy arriving does not);
        one the browser cannot play is then replaced in the player by a copy it can play. Nothing is shown
        once another video has been put in the player meanwhile (`shown`, video_put)."""
        source = source_of(video) if video else None
        info, frames = self.video_frames(video, video_fps, video_max_frames)
        is_copy = source != video
        try:
            video_codec = codec(video) if video and not is_copy else None
        except UserError:  # the sampling says why
            video_codec = None
        if shown.source != source:
            yield _skipped()
            return
        if not video_codec or browser_plays(video, video_codec):
            yield info, frames, gr.skip() if is_copy else [], _note(_copy_shown() if is_copy else None), gr.skip()
            return
        yield info, frames, [], _note(MSG_VIDEO_NOT_PLAYABLE.format(codec=video_codec)), gr.skip()
        try:
            made = browser_copy(video)
        except (UserError, OSError):  # the upload expired meanwhile, say
            made = None
        if shown.source != source:
            yield _skipped()  # Gradio sends a generator's last update again when it ends: not the old one
            return
        if made is None:
            yield gr.skip(), gr.skip(), gr.skip(), _note(MSG_VIDEO_NO_BROWSER_COPY.format(codec=video_codec)), gr.skip()
        else:
            yield gr.skip(), gr.skip(), gr.skip(), gr.skip(), made  # its arrival in the player brings its note

    @staticmethod
    def video_frames(video: str | None, video_fps: float, video_max_frames: int):
        """(the sampling, the frames): the frames the engine will sample, read as the engine reads them."""
        if not video:
            return MSG_VIDEO_HINT, gr.update(**HIDDEN)
        try:
            sampled = sample_video(source_of(video), video_fps, int(video_max_frames), longest_side=FRAME_SIDE)
        except UserError as error:
            return f"⚠️ {error}", gr.update(**HIDDEN)
        count = len(sampled.frame_indices)
        text = MSG_VIDEO_SAMPLING.format(seconds=sampled.total_frames / sampled.native_fps, fps=sampled.native_fps,
                                         total=sampled.total_frames, count=count)
        frames = [(Image.fromarray(frame), clock(seconds)) for frame, seconds in zip(sampled.frames, sampled.timestamps_s)]
        label = f"The {count} frame{'s' if count > 1 else ''} the model will see"
        return "\n\n".join([text, *sampled.notices]), gr.update(value=frames, visible=True, label=label)
