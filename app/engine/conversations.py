"""Conversations kept between turns, so that a follow-up prefills only what is new.

A chat's next prompt repeats the whole conversation so far. Its text model's state after a prefix of it
(the DeltaNet layers' recurrent and convolution states, the attention layers' keys and values) is kept
here, and a later prompt that starts with exactly that prefix, token for token and with the same images
or video, goes on from it: its earlier media are not encoded again, and only its new tokens are prefilled.

Where a state is kept: the recurrent state cannot be rewound, so it is taken where the next prompt is sure
to agree with this one. That is where this prompt's last turn begins (its generation prompt, a
`<|im_start|>` token): MiniCPM-V's chat template renders a past assistant turn without the reasoning
block the reply was generated after (../shared/reference/minicpm-v-4.6/chat_template.jinja), so what
follows differs, while everything before it is rendered again as it was. Each prompt is prefilled up to
there, its state kept, then the rest is prefilled from it (app.model.runner.prefill_continued).

Memory is bounded: the least recently used conversations go first once the kept states pass
tuning.CONVERSATION_CACHE_GB. A prompt whose conversation was let go is prefilled whole, and gets the
same reply. A prompt whose last turn starts fewer than tuning.CONVERSATION_CACHE_MIN_TOKENS tokens in is
prefilled whole and not kept: the split and the copy would cost more than prefilling it again saves
(docs/DECISIONS.md D48), unless it holds a video, which a follow-up would otherwise sample again (D70).
Matches are exact, so kept states never leak between conversations: a prompt reuses one only if it repeats
that conversation token for token, with the same media files (docs/SECURITY.md).
"""

import logging
import os
from collections import Counter
from dataclasses import dataclass

from app.engine.bounded_cache import BoundedCache
from app.engine.jpegs_on_device import DECODED_PIXELS, DEFERRED_IMAGES
from app.engine.settings import GenerationSettings

log = logging.getLogger(__name__)

TURN_START = "<|im_start|>"  # where a turn of the chat template (ChatML, as MiniCPM-V's) begins
# A prompt is looked for at the starts of its last few turns only: a follow-up, a Retry, an Undo go on from its
# conversation's latest states, and making a key copies the prompt up to there (a prompt of thousands of turns
# would cost tens of ms).
LOOKED_AT_TURNS = 8


@dataclass(eq=False)
class KeptConversation:
    """A conversation's state after its first `length` tokens, with what they were."""

    key: tuple  # (its token ids as bytes, its media's identities)
    length: int
    state: object  # the runner's snapshot (app.model.batch_cache.StateSnapshot): has nbytes


class ConversationCache(BoundedCache):
    """Kept conversations, least recently used first, up to `capacity_bytes` of state; a prompt without a video
    whose last turn starts fewer than `min_tokens` tokens in is not kept (tuning.CONVERSATION_CACHE_MIN_TOKENS,
    fewest_tokens). Used from the request threads (find) and the scheduler's (keep)."""

    def __init__(self, capacity_bytes: int, min_tokens: int = 0):
        super().__init__(capacity_bytes)  # self._kept: KeptConversation by key
        self.min_tokens = min_tokens
        self._media = Counter()  # the media keys of the kept conversations, each with how many hold it

    def held_media(self) -> frozenset:
        """The keys of the media some kept conversation holds: a preparer need not decode an image of these
        (app.engine.inputs.prepare_inputs), if the conversation is still kept when it is found."""
        with self._lock:
            return frozenset(self._media)

    def find(self, prepared) -> KeptConversation | None:
        """The longest kept conversation `prepared` (app.engine.inputs.PreparedInputs) goes on from, or None.
        Only the starts of its last LOOKED_AT_TURNS turns are looked at: that is where states are kept, and a
        follow-up, a Retry, an Undo or an edit of a recent turn goes on from one of them. Their keys are made
        before the lock is taken: the scheduler's thread waits on it. None is kept before fewest_tokens."""
        starts = [start for start in prepared.turn_starts[-LOOKED_AT_TURNS:] if start >= self.fewest_tokens(prepared)]
        if not self._kept or not starts:
            return None
        tokens = _token_bytes(prepared)
        keys = [_key(tokens, prepared, start) for start in reversed(starts)]
        with self._lock:
            for key in keys:
                found = self._kept.get(key)
                if found is not None:
                    self._kept.move_to_end(found.key)
                    return found
        return None

    def fewest_tokens(self, prepared) -> int:
        """How many tokens in a prompt's last turn must start for it to be kept: min_tokens, or none for a prompt
        with a video, whose every follow-up would otherwise sample the video's frames again on a CPU core
        (app.engine.held_videos; docs/DECISIONS.md D70)."""
        return 0 if prepared.video_tokens else self.min_tokens

    def superseded(self, kept: KeptConversation) -> None:
        """A newer state of `kept`'s conversation is kept: `kept` is let go first when room is needed (it
        serves an Undo or an edit of the latest question only)."""
        with self._lock:
            if self._kept.get(kept.key) is kept:
                self._kept.move_to_end(kept.key, last=False)

    def keep(self, prepared, state) -> None:
        """Keep `state`, a prompt's state after its last turn's start (prepared.turn_starts[-1])."""
        nbytes = state.nbytes
        if nbytes > self.capacity_bytes:
            return
        length = prepared.turn_starts[-1]
        kept = KeptConversation(_key(_token_bytes(prepared), prepared, length), length, state)
        with self._lock:
            old = self._kept.pop(kept.key, None)
            if old is not None:
                self._let_go(old)
            self._kept[kept.key] = kept
            self._held += nbytes
            self._media.update(kept.key[1])
            while self._held > self.capacity_bytes:
                self._let_go(self._kept.popitem(last=False)[1])

    def _let_go(self, kept: KeptConversation) -> None:
        self._held -= kept.state.nbytes
        self._media.subtract(kept.key[1])
        self._media = +self._media  # without the keys no conversation holds any more

    def clear(self) -> None:
        """Let every kept state go (its model is being unloaded)."""
        with self._lock:
            self._kept.clear()
            self._held = 0
            self._media.clear()


def _token_bytes(prepared) -> bytes:
    return prepared.tensors["input_ids"][0].numpy().tobytes()


def _key(tokens: bytes, prepared, length: int) -> tuple:
    """A prefix's key: its tokens, and the identities of the media whose placeholders lie in it."""
    size = len(tokens) // prepared.prompt_tokens
    media = tuple(key for key, end in zip(prepared.media_keys, prepared.media_ends) if end <= length)
    return tokens[:length * size], media


def prefill_wave(runner, cache: ConversationCache, wave: list, features: list, first_slot: int,
                 columns: int) -> tuple[list, object]:
    """Prefill a wave of requests (app.engine.scheduler.Request, their media encoded: `features`) into slots
    first_slot, first_slot + 1, ...; `columns` is room each needs. Returns the requests in slot order and
    their next-token logits.

    Without the cache, or for a prompt it cannot keep or that is too short to keep (cache.fewest_tokens), the
    whole prompt at once (runner.prefill). Else up to its last turn's start, from a kept conversation if one
    matches (restored into its slot, its media not encoded: app.engine.inputs.without_media_before), the
    state there kept, then the rest."""
    whole, fresh, going_on = [], [], []
    for request, feature in zip(wave, features):
        prepared = request.prepared
        if not (cache.enabled and runner.continues and prepared.turn_starts and prepared.canvas is None):
            whole.append((request, feature))
        elif prepared.kept is not None:
            going_on.append((request, feature))
        else:
            (fresh if _turn(request) >= cache.fewest_tokens(prepared) else whole).append((request, feature))
    ordered = whole + fresh + going_on
    slots = {id(request): first_slot + index for index, (request, _) in enumerate(ordered)}
    logits = []
    if whole:  # a copy: a captured prefill's logits are its graph's, which the next replay of it overwrites
        logits.append(runner.prefill([(r.prepared.tensors["input_ids"], f, r.prepared.canvas) for r, f in whole],
                                     first_slot, columns).clone())
    if fresh:
        runner.prefill([(_ids(r, 0, _turn(r)), f, None) for r, f in fresh], first_slot + len(whole), columns)
    if going_on:
        runner.restore([r.prepared.kept.state for r, _ in going_on], [slots[id(r)] for r, _ in going_on], columns)
    heads = [(r, f) for r, f in going_on if _turn(r) > r.prepared.kept.length]
    if heads:
        runner.prefill_continued([(_ids(r, r.prepared.kept.length, _turn(r)), f) for r, f in heads],
                                 [r.prepared.kept.length for r, _ in heads], [slots[id(r)] for r, _ in heads], columns)
    kept = fresh + heads
    states = runner.snapshots([slots[id(r)] for r, _ in kept], [_turn(r) for r, _ in kept]) if kept else None
    for (request, _), state in zip(kept, states or ()):
        cache.keep(request.prepared, state)
        if request.prepared.kept is not None:
            cache.superseded(request.prepared.kept)
    rest = fresh + going_on  # each prompt's last turn, from the state kept at its start
    if rest:
        logits.append(runner.prefill_continued([(_ids(r, _turn(r), None), None) for r, _ in rest],
                                               [_turn(r) for r, _ in rest], [slots[id(r)] for r, _ in rest], columns))
    for request, _ in going_on:
        request.prepared.kept = None  # its state is in its slot now: the cache may let it go
    return [request for request, _ in ordered], runner.joined(logits)


def _turn(request) -> int:
    """Where the request's last turn starts: its prompt's kept state is taken there."""
    return request.prepared.turn_starts[-1]


def _ids(request, start: int, end: int | None):
    return request.prepared.tensors["input_ids"][:, start:end]


def mark_turns_and_media(prepared, tokenizer, input_ids, image_paths: list[str], plan,
                          video: tuple[str, tuple[int, int, int]] | None, settings: GenerationSettings) -> None:
    """Fill in what a kept conversation is matched by (PreparedInputs.turn_starts and the media's), for a
    prompt whose images' tokens lie where `plan` says, or that holds `video` (its path, and its sampled frames'
    count, height and width)."""
    turn_start = tokenizer.convert_tokens_to_ids(TURN_START)
    if turn_start is None or turn_start == tokenizer.unk_token_id:
        return
    prepared.turn_starts = tuple((input_ids == turn_start).nonzero()[:, 0].tolist())
    ends, keys = [], []
    if image_paths:
        placeholders = (input_ids == tokenizer.image_token_id).nonzero()[:, 0].tolist()
        last = 0
        for path, image in zip(image_paths, plan.images):
            last += image.tokens
            ends.append(placeholders[last - 1] + 1)
            keys.append(image_key(path, settings.downsample_mode, plan.max_slice_nums))
        prepared.image_views = tuple(1 + image.slice_count for image in plan.images)
    if video is not None and prepared.video_tokens:
        ends.append(int((input_ids == tokenizer.video_token_id).nonzero()[-1, 0]) + 1)
        keys.append(video_key(*video, settings))
    prepared.media_keys, prepared.media_ends = tuple(keys), tuple(ends)


def image_key(path: str, downsample_mode: str, max_slice_nums: int) -> str:
    """An image's identity in a kept conversation: its file's, and how it was cut and encoded."""
    return f"{file_identity(path)}|{downsample_mode}|{max_slice_nums}"


def video_key(path: str, shape: tuple[int, int, int], settings: GenerationSettings) -> str:
    """A video's identity in a kept conversation: its file's, how its frames were sampled (and how many, of what
    size, were read), and how they were cut and encoded."""
    frames, height, width = shape
    return (f"{file_identity(path)}|{settings.downsample_mode}|{settings.video_fps}|{settings.video_max_frames}|"
            f"{settings.video_slices_per_frame}|{frames}x{height}x{width}")


def file_identity(path: str) -> str:
    """A media file's identity: uploads are written once and never changed (a new upload is a new file, in
    a folder of its own), and the API's are named by a hash of their bytes (app.web.data_urls), which touches
    them when they come again: their times are not part of it."""
    status = os.stat(path)
    return f"{os.path.realpath(path)}|{status.st_ino}|{status.st_size}"


def without_media_before(prepared, position: int) -> None:
    """Drop the pixels (or the images left to the engine to slice) of the media whose placeholders all lie before
    `position`: a kept conversation holds them, so only the rest is encoded."""
    tensors = prepared.tensors
    kept = sum(end <= position for end in prepared.media_ends)
    if not kept:
        return
    if prepared.video_tokens:  # a video, the request's only medium (app.engine.request_media.media_fit)
        tensors["pixel_values_videos"] = None
        return
    views = sum(prepared.image_views[:kept])
    sizes = tensors["target_sizes"]
    deferred = tensors.get(DEFERRED_IMAGES)
    if deferred is not None:
        rest = deferred.after(kept)
        tensors[DEFERRED_IMAGES] = rest if rest.paths else None
        if not any(rest.decoded):
            tensors.pop(DECODED_PIXELS, None)
    elif views >= len(sizes) or tensors.get("pixel_values") is None:  # all kept, or none decoded (pixels_left_out)
        tensors["pixel_values"] = None
    else:
        patch = tensors["pixel_values"].shape[2]
        width = int((sizes[:views, 0] * sizes[:views, 1]).sum()) * patch
        tensors["pixel_values"] = tensors["pixel_values"][..., width:]
    tensors["target_sizes"] = sizes[views:]
