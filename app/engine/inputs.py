"""Where a conversation becomes model inputs: media loaded, slices planned, prompt rendered, tokens counted."""

import copy
from dataclasses import dataclass, field

from app import limits
from app.messages import (
    MSG_CONTEXT_TOO_LONG,
    MSG_CONTEXT_TRIMMED,
    MSG_EMPTY_REQUEST,
    MSG_MEDIA_TRIMMED,
    MSG_NOT_TEXT,
    MSG_PROMPT_TOO_LONG,
)
from app.chat import THINK_OPEN
from app.engine.conversations import image_key, mark_turns_and_media
from app.engine.held_videos import held_video
from app.engine.prompt_text import TextPartsAsText, with_placeholders
from app.engine.request_media import check_media_fit, image_sizes, media_fit, media_paths
from app.engine.settings import GenerationSettings
from app.errors import UserError
from app.media.budget import plan_slices
from app.engine.jpegs_on_device import DECODED_PIXELS_MAX_BYTES, PlannedSlices, deferred_images, defers_jpegs, stand_in_images
from app.media.images import jpeg_for_the_device, load_image_pixels
from app.media.video import sample_video


@dataclass
class PreparedInputs:
    tensors: dict  # processor output, ready for the model
    prompt_tokens: int
    image_tokens: list[int] = field(default_factory=list)  # per image, in prompt order
    video_tokens: int = 0
    video_frames: int = 0
    notices: list[str] = field(default_factory=list)
    opens_thinking: bool = False  # the chat template left a reasoning block open for the reply
    canvas: tuple | None = None  # M-RoPE positions and offset (MiniCPM-V 4.7): canvas_positions
    # perf_counter() readings at the preparation's stages (manager.preparation_stages); one clock for all of a
    # machine's processes (CLOCK_MONOTONIC), so a worker's readings can be set against the engine's.
    timeline: dict = field(default_factory=dict)
    # What app.engine.conversations matches a kept conversation by: where each turn starts in the prompt (its
    # <|im_start|> token), each image's (or the video's) identity and the position after its last placeholder,
    # and each image's views (its source view and slices, in pixel_values' order).
    turn_starts: tuple[int, ...] = ()
    media_keys: tuple[str, ...] = ()
    media_ends: tuple[int, ...] = ()
    image_views: tuple[int, ...] = ()
    kept: object = None  # the kept conversation this prompt goes on from (set by the engine)
    # Its images (or its video) were not decoded: kept conversations (or encoded images) hold them all.
    pixels_left_out: bool = False
    image_features: list | None = None  # those of its images its kept conversation does not hold, if encoded before

    @property
    def visual_tokens(self) -> int:
        return sum(self.image_tokens) + self.video_tokens

    def drop_pixels(self) -> None:
        """Let the pixels go once their features are computed: a running reply holds on to its prompt only."""
        for key in PIXEL_KEYS:
            if key in self.tensors:
                self.tensors[key] = None


PIXEL_KEYS = ("pixel_values", "pixel_values_videos")


def _check_text(messages: list[dict]) -> None:
    for message in messages:
        for part in message["content"]:
            if part["type"] != "text":
                continue
            if len(part["text"]) > limits.MAX_PROMPT_CHARS:
                raise UserError(MSG_PROMPT_TOO_LONG.format(count=len(part["text"]), limit=limits.MAX_PROMPT_CHARS))
            try:
                part["text"].encode("utf-8")
            except UnicodeEncodeError as error:  # a lone surrogate, which JSON can carry and no tokenizer takes
                raise UserError(MSG_NOT_TEXT.format(position=error.start + 1)) from None


def prepare_inputs(processor, messages: list[dict], settings: GenerationSettings, max_context_tokens: int,
                   pixel_dtype=None, jpegs_on_device: bool = False, kept_media: frozenset = frozenset(),
                   may_hold_gil: bool = False) -> PreparedInputs:
    """Model inputs for the conversation; the oldest turns are left out (with a notice) when it holds more
    media than one request may (the latest turn alone still must fit), then while it outgrows the context.
    A system message (first, if any) is always kept.

    Floating-point pixels come in `pixel_dtype` (the vision tower's): the model would cast them on the GPU
    anyway, and float32 doubles what crosses from a worker process and to the GPU (24 MB for one 1344x1344
    image). The app's processor leaves images and videos in uint8 (app.engine.processor), where a
    processor as shipped would give them in float32.
    With `jpegs_on_device` (the engine makes images' slices on its GPU), a request's images get no slices here:
    its tensors hold the images' DeferredImages instead, with the decoded pixels of those that are not JPEGs the
    GPU decodes as the CPU does (app.engine.jpegs_on_device).
    A request whose every image a kept conversation holds (their keys in `kept_media`: a follow-up) gets none
    either, and says so (pixels_left_out): the engine encodes none of them (app.engine.conversations). So does
    one whose video a kept conversation holds (app.engine.held_videos).
    `may_hold_gil`: nothing else of this process waits to run (a preparing worker process; load_image_pixels).
    """
    if not messages or messages[-1]["role"] != "user":
        raise UserError(MSG_EMPTY_REQUEST)
    _check_text(messages)
    images: dict[str, object] = {}  # path -> decoded pixels, kept across trimming attempts
    sizes: dict[str, tuple[int, int]] = {}  # path -> (height, width), from its header, likewise
    system = messages[:1] if messages[0]["role"] == "system" else []  # kept whatever is left out
    turn_starts = [i for i, message in enumerate(messages) if message["role"] == "user"]
    media_start = next((start for start in turn_starts if media_fit(messages[start:], sizes)), turn_starts[-1])
    starts = turn_starts[turn_starts.index(media_start):]
    tried: dict[int, tuple[PreparedInputs, int]] = {}  # an index of `starts` -> (its inputs, tokens they need)

    def needed(index: int) -> int:
        if index not in tried:
            prepared = _prepare(processor, system + messages[starts[index]:], settings, images, sizes,
                                jpegs_on_device, kept_media, may_hold_gil)
            tried[index] = (prepared, prepared.prompt_tokens + settings.max_new_tokens)
        return tried[index][1]

    # The earliest start that fits: the first at once (the common case), else by halving, as fewer turns never
    # need more tokens (tried one by one, a conversation of thousands of turns took minutes).
    index = 0
    if needed(0) > max_context_tokens:
        low, high = 1, len(starts) - 1  # those before `low` do not fit, those after `high` do
        while low <= high:
            middle = (low + high) // 2
            low, high = (low, middle - 1) if needed(middle) <= max_context_tokens else (middle + 1, high)
        if low == len(starts):
            raise UserError(MSG_CONTEXT_TOO_LONG.format(count=needed(len(starts) - 1), limit=max_context_tokens))
        index = low
    prepared, start = tried[index][0], starts[index]
    left_out = start - len(system)
    if start > media_start:
        prepared.notices.insert(0, MSG_CONTEXT_TRIMMED.format(count=left_out, limit=max_context_tokens))
    elif left_out:
        prepared.notices.insert(0, MSG_MEDIA_TRIMMED.format(count=left_out, limit=limits.MAX_IMAGES_PER_REQUEST,
                                                            pixels=limits.MAX_REQUEST_IMAGE_PIXELS))
    for key in PIXEL_KEYS if pixel_dtype is not None else ():
        pixels = prepared.tensors.get(key)
        if pixels is not None and pixels.is_floating_point():
            prepared.tensors[key] = pixels.to(pixel_dtype)
    return prepared


def thinks_by_default(processor) -> bool:
    """Whether the checkpoint's chat template reasons when a request does not say: a question rendered
    without `enable_thinking` comes out as with it on (and not as with it off)."""
    question = [{"role": "user", "content": [{"type": "text", "text": "Hello"}]}]

    def rendered(**thinking) -> str:
        return processor.apply_chat_template(question, add_generation_prompt=True, tokenize=False, **thinking)

    unset = rendered()
    return unset == rendered(enable_thinking=True) != rendered(enable_thinking=False)


def canvas_positions(model, tensors: dict, downsample_mode: str) -> tuple | None:
    """A prompt's M-RoPE positions [3, length] and what later tokens add to their text position, for a
    model that lays images out on canvases (MiniCPM-V 4.7, through its own get_rope_index); None when
    positions are plain token counts (4.6, or a prompt without media). CPU work on the prompt's ids."""
    get_rope_index = getattr(model.model, "get_rope_index", None)
    media = tensors.get("target_sizes") is not None or tensors.get("target_sizes_videos") is not None
    if get_rope_index is None or tensors.get("mm_token_type_ids") is None or not media:
        return None
    positions, deltas = get_rope_index(
        tensors["input_ids"], tensors["mm_token_type_ids"], target_sizes=tensors.get("target_sizes"),
        target_sizes_videos=tensors.get("target_sizes_videos"), downsample_mode=downsample_mode)
    return positions[:, 0], int(deltas[0, 0])


def _video_kwargs(frames, settings: GenerationSettings) -> dict:
    """The processor's arguments for a video's sampled frames, as the model card says to process them."""
    return {
        "videos": [frames],
        # No <image_id> numbering for video frames (the card). transformers reads the flag only at the call's
        # top level (or in images_kwargs), not in videos_kwargs; a video request holds no images
        # (request_media.media_fit), so here it reaches the frames alone.
        "use_image_id": False,
        "videos_kwargs": {
            "input_data_format": "channels_first",  # app.media.video.sample_video(channels_first=True)
            "max_slice_nums": settings.video_slices_per_frame,
            "downsample_mode": settings.downsample_mode,
            "do_sample_frames": False,  # frames were sampled by app.media.video
        },
    }


def _video(processor, messages: list[dict], paths: list[str], settings: GenerationSettings, kept_media: frozenset):
    """For the request's video, if any: (the processor's arguments; the video processor's stand-in where a kept
    conversation holds it, else None: sampled; its frames' (count, height, width); notices for the user)."""
    if not paths:
        return {}, None, None, ()
    planned = held_video(processor, messages, paths[0], settings, kept_media)
    if planned is not None:
        return _video_kwargs(planned.stand_in(), settings), planned, planned.shape, ()
    video = sample_video(paths[0], settings.video_fps, settings.video_max_frames, channels_first=True)
    count, _, height, width = video.frames.shape
    return _video_kwargs(video.frames, settings), None, (count, height, width), video.notices


def _loaded_images(paths: list[str], images: dict, on_device: bool, may_hold_gil: bool) -> tuple[list, bool]:
    """Each image's pixels (cached in `images` across trimming attempts), or a JPEG's (height, width) where the
    engine decodes it (`on_device`: jpeg_for_the_device); and whether the engine makes the slices: not past
    DECODED_PIXELS_MAX_BYTES of decoded pixels."""
    for path in paths:
        if path not in images:
            images[path] = (on_device and jpeg_for_the_device(path)) or load_image_pixels(path, may_hold_gil)
    if on_device and sum(images[p].numel() for p in paths if not isinstance(images[p], tuple)) > DECODED_PIXELS_MAX_BYTES:
        for path in paths:
            if isinstance(images[path], tuple):
                images[path] = load_image_pixels(path, may_hold_gil)
        on_device = False
    return [images[path] for path in paths], on_device


def _held_by_kept_conversations(processor, messages: list[dict], paths: list[str], settings: GenerationSettings,
                                kept_media: frozenset, sizes: dict) -> list[tuple[int, int]] | None:
    """The images' (height, width) from their headers if kept conversations or encoded images hold every one
    (their keys in `kept_media`: app.engine.encoded_images), else None. Never for an image of the last question,
    which no kept state of this conversation can hold: if another's held it, this one would be prepared twice
    (and would learn, from the time it took, that someone had sent that file)."""
    if not paths or not kept_media or any(part["type"] == "image" for part in messages[-1]["content"]):
        return None
    upright = image_sizes(paths, sizes)
    plan = plan_slices(processor.image_processor, upright, settings.max_slice_nums, settings.downsample_mode,
                       settings.visual_token_budget)
    held = all(image_key(path, settings.downsample_mode, plan.max_slice_nums) in kept_media for path in paths)
    return upright if held else None


def _image_plan_and_arguments(processor, loaded: list, stand_ins: bool, settings: GenerationSettings):
    """(the slice plan, the processor's image arguments) for the request's images (pixels, or a JPEG's (height,
    width)); the processor is handed `stand_ins` where no slices are made here (the engine makes them, or none)."""
    if not loaded:
        return None, {}
    sizes = [image if isinstance(image, tuple) else tuple(image.shape[1:]) for image in loaded]
    plan = plan_slices(processor.image_processor, sizes, settings.max_slice_nums, settings.downsample_mode,
                       settings.visual_token_budget)
    return plan, {"images": [stand_in_images(len(loaded)) if stand_ins else loaded],
                  "images_kwargs": {"max_slice_nums": plan.max_slice_nums, "downsample_mode": settings.downsample_mode,
                                    "input_data_format": "channels_first"}}  # a 3-pixel side reads as channels


def _prepare(processor, messages: list[dict], settings: GenerationSettings, images: dict, sizes: dict,
             jpegs_on_device: bool, kept_media: frozenset, may_hold_gil: bool) -> PreparedInputs:
    image_paths = media_paths(messages, "image")
    video_paths = media_paths(messages, "video")
    check_media_fit(messages, sizes)

    left_out = _held_by_kept_conversations(processor, messages, image_paths, settings, kept_media, sizes)
    on_device = jpegs_on_device and defers_jpegs(processor)  # the engine makes the slices (D43)
    if left_out:
        loaded = left_out
    else:
        loaded, on_device = _loaded_images(image_paths, images, on_device, may_hold_gil)
    sizes_only = bool(loaded) and (on_device or bool(left_out))  # no pixels for the processor
    plan, processor_kwargs = _image_plan_and_arguments(processor, loaded, sizes_only, settings)
    notices = [plan.notice()] if plan is not None and plan.notice() else []
    video_arguments, planned, video_shape, video_notices = _video(processor, messages, video_paths, settings,
                                                                  kept_media)
    processor_kwargs.update(video_arguments)
    notices.extend(video_notices)

    template_messages, texts, mark = with_placeholders(messages)
    # Unset, the flag is not passed: the checkpoint's template decides (a Thinking build may default on).
    thinking = {} if settings.enable_thinking is None else {"enable_thinking": settings.enable_thinking}
    prompt = processor.apply_chat_template(template_messages, add_generation_prompt=True, tokenize=False, **thinking)
    text_safe = copy.copy(processor)  # the processor's other parts are shared, not copied
    text_safe.tokenizer = TextPartsAsText(processor.tokenizer, texts, mark)
    if sizes_only:
        text_safe.image_processor = PlannedSlices(processor.image_processor, plan.images)
    if planned is not None:
        text_safe.video_processor = planned
    tensors = dict(text_safe(text=[prompt], return_tensors="pt", **processor_kwargs))
    if sizes_only and not left_out:
        tensors.update(deferred_images(image_paths, loaded, plan.images, processor.image_processor.patch_size))
    if loaded and (sizes_only or not tensors["pixel_values"].is_floating_point()):
        tensors["pixel_normalization"] = processor.pixel_normalization
    if video_shape and planned is None and not tensors["pixel_values_videos"].is_floating_point():
        tensors["video_pixel_normalization"] = processor.video_pixel_normalization
    input_ids = tensors["input_ids"][0]
    tokenizer = processor.tokenizer
    image_tokens = list(plan.tokens_per_image) if plan else []
    counted = int((input_ids == tokenizer.image_token_id).sum())
    if counted != sum(image_tokens):
        # The planner mirrors the processor's geometry; if a checkpoint's processor differs, trust the count.
        image_tokens = [counted] if counted else []
    prepared = PreparedInputs(
        tensors=tensors,
        prompt_tokens=int(input_ids.numel()),
        image_tokens=image_tokens,
        video_tokens=int((input_ids == tokenizer.video_token_id).sum()),
        video_frames=video_shape[0] if video_shape else 0,
        notices=notices,
        opens_thinking=prompt.rstrip().endswith(THINK_OPEN),
        pixels_left_out=bool(left_out) or planned is not None,
    )
    if plan is None or counted == plan.total_tokens:  # else where each image's tokens lie is not known
        mark_turns_and_media(prepared, tokenizer, input_ids, image_paths, plan,
                             (video_paths[0], video_shape) if video_shape else None, settings)
    return prepared
