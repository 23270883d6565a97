"""What the benchmarks' users send (concurrency.py --workload, follow_ups.py): each workload's file and
messages, one user's run of requests, and those messages as the OpenAI-compatible API takes them.

Messages are the engine's (app.chat): {"role", "content": [{"type": "image" | "video", "path"}, {"type": "text",
"text"}]}. A follow-up's user opens its conversation once, before the level's clock: its own copy of the image
(own_copy) and a question of its own (so that no two users hold the same conversation or image), answered by the
engine. In engine mode each
timed request is the next turn of that conversation, which grows by each question and its answer, as a
chat's does, for FOLLOW_UP_TURNS turns (the first round fewer), then starts again from its opening (in app
mode the server keeps it, and it grows for the whole level); the OpenAI-style modes send the opening and its
answer again each time with a new question. No question is sent twice, so that no request repeats a whole earlier
prompt.
"""

import base64
import mimetypes
import os
import tempfile
import zlib
from contextlib import closing
from dataclasses import dataclass, field
from functools import cache

from benchmarks.real_shape import QUESTION

WORKLOADS = ("image-1344", "image-448", "text", "follow-up", "video-16")
TEXT_PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."
VIDEO_QUESTION = "Describe what happens in this video."
FOLLOW_UP_QUESTION = "And what about the left corner of the image?"
# 16 frames: a 16-second clip sampled at 1 frame a second, capped at 16 (app.media.video.sampled_frame_indices).
VIDEO_SECONDS = 16
VIDEO_SETTINGS = {"video_fps": 1.0, "video_max_frames": 16}


@dataclass(frozen=True)
class Workload:
    name: str
    media: dict | None  # the part that the first user turn holds: {"type": "image" | "video", "path": ...}
    question: str
    settings: dict = field(default_factory=dict)  # generation settings beyond the benchmark's own
    follow_up: bool = False

    def opening_turn(self, user: int) -> dict:
        """A follow-up's first user turn: this user's own copy of the image and its own first question."""
        return user_turn(image_part(own_copy(self.media["path"], user)), f"User {user}: {QUESTION}")

    def timed_turn(self, user: int, request: int) -> dict:
        """The last user turn of a timed request, the `request`-th of `user`. Every request's words are its own,
        so that none repeats another's whole prompt, which the engine's conversation cache would answer from
        what it kept (app.engine.conversations) as it would a Retry."""
        if self.follow_up:
            return user_turn(None, f"{FOLLOW_UP_QUESTION} (question {request})")
        return user_turn(self.media, f"{self.question} (request {user}.{request})")


def make_workload(name: str, image_format: str | None = None) -> Workload:
    """The workload `name`, its file written into the temporary folder. `image_format` (png or jpeg) is
    for the 1344x1344 image of image-1344 (png by default: every table of RESULTS.md) and follow-up (jpeg)."""
    if name == "image-1344":
        return Workload(name, image_part(noise_image(1344, image_format or "png")), QUESTION)
    if name == "follow-up":
        return Workload(name, image_part(noise_image(1344, image_format or "jpeg")), QUESTION, follow_up=True)
    if name == "image-448":
        return Workload(name, image_part(noise_image(448, "jpeg")), QUESTION)
    if name == "text":
        return Workload(name, None, TEXT_PROMPT)
    if name == "video-16":
        return Workload(name, {"type": "video", "path": make_video()}, VIDEO_QUESTION, dict(VIDEO_SETTINGS))
    raise ValueError(f"unknown workload {name!r}: one of {', '.join(WORKLOADS)}")


def noise_image(side: int, image_format: str, tag: str = "") -> str:
    """A new side x side noise image, as benchmark_request makes its own (a JPEG of quality 90); `tag` names
    a file apart from the others of its size."""
    from PIL import Image

    path = os.path.join(tempfile.gettempdir(), f"benchmark-{side}{tag}.{image_format}")
    Image.effect_noise((side, side), 64).convert("RGB").save(path, **({"quality": 90} if image_format == "jpeg" else {}))
    return path


def image_part(path: str) -> dict:
    return {"type": "image", "path": path}


def own_copy(path: str, user: int) -> str:
    """The image at `path` as a file of `user`'s own, its pixels the same and its bytes not, with a comment of its
    own (a JPEG's COM segment, a PNG's tEXt chunk): the app's caches know a file by its path, or by its bytes where
    it names uploads by their hash, and 200 users' photos are 200 files (app.engine.encoded_images)."""
    root, extension = os.path.splitext(path)
    copy = f"{root}-user{user}{extension}"
    with open(path, "rb") as file:
        data = file.read()
    comment = f"benchmark user {user}".encode()
    if data.startswith(b"\xff\xd8"):  # JPEG: a comment segment right after its start marker
        data = data[:2] + b"\xff\xfe" + (len(comment) + 2).to_bytes(2, "big") + comment + data[2:]
    else:  # PNG: a text chunk right after its header chunk (8 bytes of signature, then 25 of IHDR)
        body = b"tEXt" + b"Comment\x00" + comment
        data = data[:33] + (len(body) - 4).to_bytes(4, "big") + body + zlib.crc32(body).to_bytes(4, "big") + data[33:]
    with open(copy, "wb") as file:
        file.write(data)
    return copy


def make_video(seconds: int = VIDEO_SECONDS, fps: int = 24, size: tuple[int, int] = (640, 360)) -> str:
    """An mp4v clip (OpenCV's writer, as the tests make theirs: tests/conftest.py): a gradient that drifts
    and a square that crosses it, so that frames differ as a film's do."""
    import cv2
    import numpy as np

    path = os.path.join(tempfile.gettempdir(), f"benchmark-video-{seconds}s.mp4")
    width, height = size
    writer = cv2.VideoWriter(path, cv2.VideoWriter_fourcc(*"mp4v"), fps, size)
    columns = np.arange(width, dtype=np.int32)
    for index in range(seconds * fps):
        frame = np.empty((height, width, 3), np.uint8)
        frame[:] = ((columns + 4 * index) % 256).astype(np.uint8)[None, :, None]
        left = index * (width - 80) // (seconds * fps)
        frame[height // 2 - 40:height // 2 + 40, left:left + 80] = (30, 60, 220)
        writer.write(frame)
    writer.release()
    return path


def user_turn(media: dict | None, text: str) -> dict:
    return {"role": "user", "content": [*([media] if media else []), {"type": "text", "text": text}]}


def assistant_turn(text: str) -> dict:
    return {"role": "assistant", "content": [{"type": "text", "text": text}]}


# A follow-up's conversation grows by this many turns at most, then starts again from its opening, so that
# a level's prompts stay near a chat's (about 2,600 tokens at the 4.6 shape, 128 new tokens a turn) however
# long it runs. Starting again is a prompt the conversation cache may no longer hold (the opening's state goes
# first once newer ones fill it), so up to one request in FOLLOW_UP_TURNS encodes its image again. A user's
# first round is cut short by its number (1 to FOLLOW_UP_TURNS turns), so that the users, who open their
# conversations together, start again at different times: at once, their image encodings made a burst that
# every reply in flight waited behind (LOG.md "Follow-ups' restarts spread out").
FOLLOW_UP_TURNS = 10


class UserRequests:
    """One user's requests of `workload`: its opening (a follow-up's image turn and its answer, and the turns
    since, see answered), then the request's own last turn."""

    def __init__(self, workload: Workload, user: int):
        self.workload, self.user = workload, user
        self.opening: list[dict] = []
        self.first_turns: list[dict] = []
        self.last: list[dict] = []
        self.sent = 0
        self.round_turns = 1 + user % FOLLOW_UP_TURNS  # the first round's; FOLLOW_UP_TURNS after it

    def open(self, answer) -> None:
        """A follow-up's opening, answered once by `answer(messages) -> the reply's text` (nothing to do for
        the other workloads)."""
        if self.workload.follow_up:
            first = self.workload.opening_turn(self.user)
            self.opening = self.first_turns = [first, assistant_turn(answer([first]))]

    def next_messages(self) -> list[dict]:
        self.sent += 1
        self.last = self.opening + [self.workload.timed_turn(self.user, self.sent)]
        return self.last

    def answered(self, text: str) -> None:
        """A follow-up's conversation goes on from the last request and `text`, its answer (engine mode), for
        round_turns turns; then from its first turns again, for FOLLOW_UP_TURNS."""
        if self.workload.follow_up:
            grown = self.last + [assistant_turn(text)]
            if len(grown) < len(self.first_turns) + 2 * self.round_turns:
                self.opening = grown
            else:
                self.opening, self.round_turns = self.first_turns, FOLLOW_UP_TURNS


def engine_reply(manager, messages: list[dict], settings) -> tuple[str, dict]:
    """The engine's whole reply to `messages`: its text as the UI puts it into the conversation, and its stats."""
    with closing(manager.stream(messages, settings)) as updates:
        for update in updates:
            pass
    return answer_text(update), update.stats


def answer_text(update) -> str:
    """A reply's last update as the UI puts it into the conversation."""
    from app.chat import reply_text, strip_reasoning

    return strip_reasoning(reply_text(update.text, update.opens_thinking))


def text_and_files(turn: dict) -> tuple[str, list[str]]:
    """A user turn as /ask takes it: its text and its files' paths."""
    text = "".join(part["text"] for part in turn["content"] if part["type"] == "text")
    return text, [part["path"] for part in turn["content"] if part["type"] != "text"]


@cache
def data_url(path: str) -> str:
    """The file as a base64 data URL, made once per file."""
    media_type = mimetypes.guess_type(path)[0]
    with open(path, "rb") as file:
        return f"data:{media_type};base64," + base64.b64encode(file.read()).decode()


def openai_messages(messages: list[dict]) -> list[dict]:
    """The engine's messages as the OpenAI-compatible API takes them: media as data URLs (docs/OPENAI_API.md)."""
    converted = []
    for message in messages:
        if message["role"] == "assistant":
            converted.append({"role": "assistant", "content": text_and_files(message)[0]})
            continue
        parts = []
        for part in message["content"]:
            if part["type"] == "text":
                parts.append(part)
            else:
                kind = f"{part['type']}_url"
                parts.append({"type": kind, kind: {"url": data_url(part["path"])}})
        converted.append({"role": "user", "content": parts})
    return converted
