"""The tiny checkpoint prompts as the real MiniCPM-V 4.6 does: its chat template renders the real one's
string byte for byte, and its tokenizer carries the real added tokens.

The real files are read from ../shared/reference/minicpm-v-4.6 beside the repository; a clone without
that folder skips these comparisons.
"""

import itertools
import json
from pathlib import Path

import pytest

REFERENCE = Path(__file__).resolve().parent.parent.parent / "shared" / "reference" / "minicpm-v-4.6"


def reference_file(name: str) -> Path:
    path = REFERENCE / name
    if not path.is_file():
        pytest.skip(f"the real checkpoint's {name} is not here ({REFERENCE} is absent outside the project's workspace)")
    return path


@pytest.fixture(scope="module")
def processor():
    """The tiny checkpoint's processor, loaded as the app loads every checkpoint's."""
    from app.engine.processor import load_processor
    from app.model.checkpoint.random_checkpoint import ensure_tiny_checkpoint

    return load_processor(ensure_tiny_checkpoint(), trust_remote_code=False)


@pytest.fixture(scope="module")
def real_template() -> str:
    return reference_file("chat_template.jinja").read_text(encoding="utf-8")


IMAGE, VIDEO = {"type": "image"}, {"type": "video"}
IMAGE_AT = {"type": "image", "path": "/tmp/cat.png"}  # as the app's messages and transformers' docs carry them
IMAGE_URL = {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}


def text(value: str) -> dict:
    return {"type": "text", "text": value}


def user(*content):
    return {"role": "user", "content": content[0] if len(content) == 1 and isinstance(content[0], str) else list(content)}


def assistant(content, **fields):
    return {"role": "assistant", "content": content, **fields}


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city"]}}}
CLOCK = {"type": "function", "function": {"name": "now", "description": "The time.", "parameters": {"type": "object"}}}
CALL = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}}
CALL_ODD = {"name": "now", "arguments": {"zone": {"name": "UTC", "offset": 0}, "fields": ["h", "m"], "exact": True,
                                         "note": None}}

CONVERSATIONS = {
    "a string": [user("Hello")],
    "white space to trim": [user("  \n Hello there \n\t ")],
    "parts, white space inside kept": [user(text("  first  "), text(""), text("  second \n"))],
    "an image, then text": [user(IMAGE, text("What is this?"))],
    "text, then an image": [user(text("What is this?"), IMAGE)],
    "an image alone": [user(IMAGE)],
    "a video alone": [user(VIDEO)],
    "several media and texts": [user(IMAGE_AT, IMAGE, text(" Compare them. "), VIDEO, text("And this?"), IMAGE_URL)],
    "white space around media": [user(text("  "), IMAGE, text(" \n"))],
    "an image in the first turn": [user(IMAGE, text("What is it?")), assistant("A cat."), user("Its colour?")],
    "media in the middle turn": [user("Hi"), assistant([text("Hello!")]), user(VIDEO, IMAGE, text("Same?")),
                                 assistant(" No. "), user("Why?")],
    "media in the last turn": [user("Hi"), assistant("Hello!"), user(text("Look:"), IMAGE, IMAGE)],
    "media-only turns": [user(IMAGE), assistant("A cat."), user(VIDEO)],
    "a system message": [{"role": "system", "content": " You are terse. "}, user(IMAGE, text("Hi"))],
    "a system message of parts": [{"role": "system", "content": [text("Be brief."), text("Be kind.")]}, user("Hi")],
    "an empty system message": [{"role": "system", "content": ""}, user("Hi")],
    "reasoning in past replies": [
        user("2+2?"), assistant("<think>\nTwo and two.\n</think>\n\n4"),
        user(IMAGE, text("And this?")), assistant([text("<think>A picture.</think>  \nA cat.")]),
        user("Thanks")],
    "reasoning as a field": [user("2+2?"), assistant("4", reasoning_content="  Two and two. "), user("Sure?")],
    "a reply with an unclosed or orphan tag": [user("a"), assistant("<think>still going"), user("b"),
                                               assistant("half</think>\nanswer"), user("c")],
    "reasoning after the question": [user("2+2?"), assistant("<think>\nTwo and two.\n</think>\n\n4")],
}
TOOL_CONVERSATIONS = {
    "tools offered": ([user("Weather in Paris?")], [WEATHER, CLOCK]),
    "tools and a system message": ([{"role": "system", "content": "Be helpful."}, user(IMAGE, text("Where?"))],
                                   [WEATHER]),
    "tools and an empty system message": ([{"role": "system", "content": "  "}, user("Hi")], [CLOCK]),
    "a tool call and its answers": ([
        user("Weather in Paris, and the time?"),
        assistant("<think>Two calls.</think>I will look.", tool_calls=[CALL, CALL_ODD]),
        {"role": "tool", "content": "Sunny, 21 C"}, {"role": "tool", "content": [text("12:00")]},
    ], [WEATHER, CLOCK]),
    "a tool call without text, then the answer": ([
        user("Weather?"), assistant("", tool_calls=[CALL]), {"role": "tool", "content": "Rain"},
        assistant("<think>It rains.</think>\n\nTake an umbrella."), user("Thanks"),
    ], [WEATHER]),
    "a tool response typed as the question": ([
        user("Weather?"), assistant("", tool_calls=[CALL]),
        user("<tool_response>\nRain\n</tool_response>"), assistant("<think>ok</think>Rain."),
    ], [WEATHER]),
}
# The generation prompt on or off; thinking on, off, not passed, and passed as None.
OPTIONS = [dict(add_generation_prompt=prompt, **thinking)
           for prompt, thinking in itertools.product((True, False), ({}, {"enable_thinking": True},
                                                                     {"enable_thinking": False},
                                                                     {"enable_thinking": None}))]


def render_both(processor, real_template, messages, **options) -> tuple[str, str]:
    """(the tiny checkpoint's prompt, the real template's), through the processor as in service."""
    ours = processor.apply_chat_template(messages, tokenize=False, **options)
    real = processor.apply_chat_template(messages, chat_template=real_template, tokenize=False, **options)
    return ours, real


@pytest.mark.parametrize("name", CONVERSATIONS)
def test_the_tiny_template_renders_what_the_real_one_does(processor, real_template, name):
    for options in OPTIONS:
        ours, real = render_both(processor, real_template, CONVERSATIONS[name], **options)
        assert ours == real, options


@pytest.mark.parametrize("name", TOOL_CONVERSATIONS)
def test_the_tiny_template_offers_tools_as_the_real_one_does(processor, real_template, name):
    messages, tools = TOOL_CONVERSATIONS[name]
    for options in OPTIONS:
        ours, real = render_both(processor, real_template, messages, tools=tools, **options)
        assert ours == real, options


def test_the_app_prompts_as_the_real_template_does(processor, real_template):
    """The messages the app renders (app.engine.prompt_text): text as placeholders, media as bare parts."""
    from app.engine.prompt_text import with_placeholders

    messages = [{"role": "user", "content": [{"type": "image", "path": "/tmp/a.png"}, text("  What is it? ")]},
                {"role": "assistant", "content": [text("A cat.")]},
                {"role": "user", "content": [text(" \n"), {"type": "video", "path": "/tmp/b.mp4"}, text("And this? ")]}]
    template_messages, _, _ = with_placeholders(messages)
    for thinking in (True, False):
        ours, real = render_both(processor, real_template, template_messages, add_generation_prompt=True,
                                 enable_thinking=thinking)
        assert ours == real


@pytest.mark.parametrize("messages", [
    [user("Hi"), {"role": "system", "content": "Late."}],
    [{"role": "system", "content": [IMAGE, text("Look.")]}, user("Hi")],
    [{"role": "system", "content": "Alone."}],
    [assistant("No question.")],
    [user("Hi"), {"role": "narrator", "content": "Meanwhile."}],
    [{"role": "user", "content": [{"type": "audio", "audio": "a.wav"}]}],
    [{"role": "user", "content": {"text": "a mapping"}}],
], ids=["late system", "image in system", "system only", "no question", "unknown role", "unknown part", "mapping"])
def test_the_tiny_template_refuses_what_the_real_one_refuses(processor, real_template, messages):
    from jinja2 import TemplateError

    for template in (None, real_template):
        with pytest.raises(TemplateError):
            processor.apply_chat_template(messages, chat_template=template, tokenize=False, add_generation_prompt=True)


def test_the_tiny_tokenizer_has_the_real_added_tokens(processor):
    """The same strings in the same order, each special or not as the real one's is (`<think>` is not)."""
    real = json.loads(reference_file("added_tokens.json").read_text(encoding="utf-8"))["added_tokens"]
    tokenizer = processor.tokenizer
    ours = [tokenizer.added_tokens_decoder[index] for index in sorted(tokenizer.added_tokens_decoder)]
    assert [(token.content, token.special) for token in ours] == [(token["content"], token["special"])
                                                                  for token in sorted(real, key=lambda t: t["id"])]
    assert not any(token.lstrip or token.rstrip or token.normalized or token.single_word for token in ours)
    assert max(tokenizer.added_tokens_decoder) < len(tokenizer) <= 1100  # small ids in a small vocabulary


def test_the_tiny_tokenizer_roles_and_media_ids(processor):
    """The real tokenizer's roles, and the model config's media ids are the tokenizer's."""
    from transformers import AutoConfig

    from app.model.checkpoint.random_checkpoint import ensure_tiny_checkpoint

    tokenizer = processor.tokenizer
    assert (tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token, tokenizer.unk_token) == (
        "<|im_start|>", "<|im_end|>", "<|endoftext|>", "<unk>")
    assert tokenizer("Hi")["input_ids"] == tokenizer("Hi", add_special_tokens=False)["input_ids"]  # no BOS added
    config = AutoConfig.from_pretrained(ensure_tiny_checkpoint())
    assert config.image_token_id == tokenizer.convert_tokens_to_ids("<|image_pad|>") == processor.image_token_id
    assert config.video_token_id == tokenizer.convert_tokens_to_ids("<|video_pad|>") == processor.video_token_id


BENCHMARK_CONFIG = Path(__file__).resolve().parent.parent / "benchmarks" / "minicpm-v-4.6.config.json"


@pytest.fixture(scope="module")
def real_shape_tokenizer(tmp_path_factory):
    """The benchmarks' checkpoint's tokenizer at the real shape (D66), saved and loaded as a checkpoint's."""
    from transformers import AutoTokenizer

    from app.model.checkpoint.random_checkpoint import _build_tokenizer

    folder = tmp_path_factory.mktemp("real-shape-tokenizer")
    _build_tokenizer(json.loads(BENCHMARK_CONFIG.read_text())["text_config"]["vocab_size"]).save_pretrained(folder)
    return AutoTokenizer.from_pretrained(folder)


def test_the_real_shape_tokenizer_has_the_real_ids(real_shape_tokenizer):
    """Its vocabulary is the real config's size, filled with plain words, and the added tokens come after them at
    the real ids."""
    from app.model.checkpoint.random_checkpoint import ADDED_TOKENS

    config, tokenizer = json.loads(BENCHMARK_CONFIG.read_text()), real_shape_tokenizer
    assert len(tokenizer) == config["text_config"]["vocab_size"]
    assert [tokenizer.added_tokens_decoder[index].content for index in sorted(tokenizer.added_tokens_decoder)] == ADDED_TOKENS
    assert tokenizer.convert_tokens_to_ids(["<|endoftext|>", "<|image_pad|>", "<|video_pad|>"]) == [
        config["eos_token_id"], config["image_token_id"], config["video_token_id"]]
    if (REFERENCE / "added_tokens.json").is_file():
        real = json.loads((REFERENCE / "added_tokens.json").read_text(encoding="utf-8"))["added_tokens"]
        assert {token["content"]: token["id"] for token in real} == {
            token.content: index for index, token in tokenizer.added_tokens_decoder.items()}


def test_the_real_shape_tokenizer_reads_text_as_the_tiny_one_and_its_replies_back(real_shape_tokenizer):
    """The texts the tiny tokenizer was trained on, and the chat markup, tokenize as there (other text may meet a
    filler word whole, as in a real vocabulary: " cats"); and a random model's reply, its tokens decoded, reads
    back as the same tokens (a follow-up's last turn holds it: app.engine.conversations)."""
    from app.model.checkpoint.random_checkpoint import _TRAINING_TEXT, _build_tokenizer

    tokenizer, tiny = real_shape_tokenizer, _build_tokenizer()
    markup = "<|im_start|>user\n<|image_pad|>What changed?<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    for text in [*_TRAINING_TEXT, markup]:
        assert tokenizer.tokenize(text) == tiny.tokenize(text)
    text = "Describe the picture: a red square, 3 cats and a café."
    assert tokenizer.decode(tokenizer(text)["input_ids"]) == text
    fillers = list(range(1_000, 248_000, 997))
    reply = tokenizer.decode(fillers)
    assert reply.startswith(" ") and tokenizer(reply)["input_ids"] == fillers
