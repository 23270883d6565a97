"""The real checkpoints' own rules (docs/ARCHITECTURE.md, the model card, ../shared/FIELD_NOTES.md): the chat
template's thinking default decides unless a request says, video frames carry no image ids, and up to 36
slices an image, counted as the processor counts them."""

import os
import shutil

import pytest
import torch

from app import limits
from app.config import AppConfig
from app.engine.core import ModelManager
from app.engine.inputs import prepare_inputs, thinks_by_default
from app.engine.processor import load_processor
from app.engine.openai_backend import OpenAIEngine
from app.engine.settings import GenerationSettings
from app.errors import UserError
from app.model.checkpoint.presets import find_preset
from app.model.checkpoint.random_checkpoint import ensure_tiny_checkpoint
from tests.conftest import make_image, make_video

# A template of the same form whose generation prompt reasons unless told not to (as a Thinking build's may).
THINKING_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['content'] is string -%}{{- message['content'] -}}"
    "{%- else -%}{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'image' -%}{{- '<|image_pad|>' -}}"
    "{%- elif part['type'] == 'video' -%}{{- '<|video_pad|>' -}}"
    "{%- elif part['type'] == 'text' -%}{{- part['text'] -}}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}"
    "{%- if enable_thinking is not defined or enable_thinking -%}{{- '<think>\\n' -}}"
    "{%- else -%}{{- '<think>\\n\\n</think>\\n\\n' -}}{%- endif -%}"
    "{%- endif -%}"
)


@pytest.fixture(scope="module")
def thinking_checkpoint(tmp_path_factory) -> str:
    folder = str(tmp_path_factory.mktemp("thinking") / "a-thinking-build")
    shutil.copytree(ensure_tiny_checkpoint(), folder)
    with open(os.path.join(folder, "chat_template.jinja"), "w") as file:
        file.write(THINKING_TEMPLATE)
    return folder


@pytest.fixture(scope="module")
def processor():
    return load_processor(ensure_tiny_checkpoint(), trust_remote_code=False)


def question(*media) -> list[dict]:
    return [{"role": "user", "content": [*({"type": kind, "path": path} for kind, path in media),
                                          {"type": "text", "text": "What is this?"}]}]


# Thinking ------------------------------------------------------------------------------------------------

def test_the_template_decides_thinking_unless_the_request_says(thinking_checkpoint, tmp_path):
    thinking = load_processor(thinking_checkpoint, trust_remote_code=False)
    plain = load_processor(ensure_tiny_checkpoint(), trust_remote_code=False)
    assert thinks_by_default(thinking) and not thinks_by_default(plain)
    messages = question(("image", make_image(tmp_path, "a.png", (300, 200), (30, 90, 200))))
    unset = GenerationSettings(max_new_tokens=8)
    assert unset.enable_thinking is None
    assert prepare_inputs(thinking, messages, unset, 8192).opens_thinking
    assert not prepare_inputs(plain, messages, unset, 8192).opens_thinking
    # A user's explicit choice wins, either way.
    assert not prepare_inputs(thinking, messages, GenerationSettings(max_new_tokens=8, enable_thinking=False), 8192).opens_thinking
    assert prepare_inputs(plain, messages, GenerationSettings(max_new_tokens=8, enable_thinking=True), 8192).opens_thinking


def test_the_engine_and_the_ui_switch_show_the_templates_default(thinking_checkpoint):
    import gradio as gr

    from app.ui.layout import build_demo

    manager = ModelManager(AppConfig(model=thinking_checkpoint, warmup=False))
    manager.load()
    try:
        assert manager.info().thinking_by_default
        assert manager.default_settings().enable_thinking is None  # nothing is passed: the template decides
        assert manager.default_settings().with_overrides({"enable_thinking": None}).enable_thinking is None
        demo = build_demo(manager)
        switch = next(block for block in demo.blocks.values()
                      if isinstance(block, gr.Checkbox) and block.label.startswith("Thinking"))
        assert switch.value is True
    finally:
        manager.preparer.close()


def test_the_thinking_bnb_build_is_a_preset():
    assert find_preset("openbmb/MiniCPM-V-4.6-Thinking-BNB").native


def test_an_external_server_hears_thinking_only_when_the_request_says():
    engine = OpenAIEngine(AppConfig(backend="openai", openai_base_url="http://127.0.0.1:9/v1", openai_model="m"))
    messages = [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}]

    def kwargs(thinking):
        return engine._payload(messages, GenerationSettings(enable_thinking=thinking)).get("chat_template_kwargs")

    assert kwargs(None) is None and kwargs(True) == {"enable_thinking": True}
    assert kwargs(False) == {"enable_thinking": False}


# Video -----------------------------------------------------------------------------------------------

def test_video_frames_carry_no_image_ids_as_the_card_says(processor, tmp_path):
    """The prompt equals what the processor makes with use_image_id=False (the card's video rule), at the
    card's defaults: 1 frame a second, up to 128 frames, one slice a frame."""
    defaults = GenerationSettings()
    assert (defaults.video_fps, defaults.video_max_frames, defaults.video_slices_per_frame) == (1.0, 128, 1)
    video = make_video(tmp_path, seconds=6, fps=8)
    prepared = prepare_inputs(processor, question(("video", video)), GenerationSettings(max_new_tokens=8), 8192)
    assert prepared.video_frames == 6
    ids = prepared.tensors["input_ids"][0]
    tokenizer = processor.tokenizer
    assert int((ids == tokenizer.convert_tokens_to_ids(tokenizer.image_id_start_token)).sum()) == 0

    from app.media.video import sample_video

    frames = sample_video(video, 1.0, 128).frames
    prompt = processor.apply_chat_template([{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "What is this?"}]}],
                                           add_generation_prompt=True, tokenize=False)
    theirs = processor(text=[prompt], videos=[frames], use_image_id=False, return_tensors="pt",
                       videos_kwargs={"max_slice_nums": 1, "do_sample_frames": False})
    assert torch.equal(ids, theirs["input_ids"][0])
    numbered = processor(text=[prompt], videos=[frames], return_tensors="pt",
                         videos_kwargs={"max_slice_nums": 1, "do_sample_frames": False, "use_image_id": False})
    assert not torch.equal(ids, numbered["input_ids"][0])  # the flag in videos_kwargs alone is not read


# Slices ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("size", [(4000, 3000), (1344, 1344), (2480, 3508), (900, 4000)], ids=str)
def test_36_slices_count_as_the_processor_counts(processor, tmp_path, size):
    """At 36 slices the app's planned visual tokens and its prompt length equal the processor's own."""
    path = make_image(tmp_path, "page.png", size, (240, 240, 230))
    settings = GenerationSettings(max_new_tokens=8, max_slice_nums=36, visual_token_budget=limits.MAX_VISUAL_TOKEN_BUDGET)
    prepared = prepare_inputs(processor, question(("image", path)), settings, 32768)
    from PIL import Image

    prompt = processor.apply_chat_template([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is this?"}]}],
                                           add_generation_prompt=True, tokenize=False)
    theirs = processor(text=[prompt], images=[[Image.open(path).convert("RGB")]], return_tensors="pt",
                       images_kwargs={"max_slice_nums": 36})
    their_image_tokens = int((theirs["input_ids"][0] == processor.tokenizer.image_token_id).sum())
    assert prepared.image_tokens == [their_image_tokens]
    assert prepared.prompt_tokens == theirs["input_ids"].shape[1]
    if size == (4000, 3000):
        assert their_image_tokens > 9 * 64 + 64  # more than 9 slices' worth


def test_slices_from_1_to_36_and_no_further():
    assert GenerationSettings().max_slice_nums == 9  # 640 tokens for a 1344x1344 image: the design's budget
    for allowed in (1, 36):
        assert GenerationSettings().with_overrides({"max_slice_nums": allowed}).max_slice_nums == allowed
    for refused in (0, 37):
        with pytest.raises(UserError, match="max_slice_nums"):
            GenerationSettings().with_overrides({"max_slice_nums": refused})
