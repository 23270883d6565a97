"""MiniCPM-V 4.7 through the batching engine: its canvas M-RoPE positions, alone and in a batch."""

import pytest

from app.config import AppConfig
from app.engine.core import ModelManager
from app.engine.replies import TextAssembler
from app.model.checkpoint.presets import find_preset
from app.model.checkpoint.random_checkpoint import TINY_CONFIG_4_7, build_random_checkpoint
from tests.conftest import make_image, make_video, normalized_as_the_engine_does
from tests.test_batching import all_at_once, greedy, reply, user


# Long enough that each conversation with media gets another reply with plain token-count positions
# (test_positions_matter_here): this random model's first 16 tokens for one image, or 32 for the video, did not.
REPLY_TOKENS = 64


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("tiny-minicpmv4_7"))
    build_random_checkpoint(path, TINY_CONFIG_4_7)
    return path


@pytest.fixture(scope="module")
def manager_4_7(folder):
    manager = ModelManager(AppConfig(model=folder, device="cpu"))
    manager.load()
    manager.warm_up()
    return manager


@pytest.fixture(scope="module")
def conversations(tmp_path_factory):
    media = tmp_path_factory.mktemp("media")
    return {
        "image": user("What is this?", ("image", make_image(media, "a.png", (1344, 900)))),
        "small": user("And this one?", ("image", make_image(media, "b.png", (90, 60), (10, 200, 30)))),
        "two": user("Compare them.", ("image", make_image(media, "c.png", (400, 700), (0, 0, 250))),
                    ("image", make_image(media, "d.png", (640, 480), (250, 250, 0)))),
        "video": user("What happens in this video?", ("video", make_video(media, seconds=3))),
        "text": user("Tell me a story about a lighthouse keeper."),
    }


def test_the_4_7_preset_is_served_natively():
    assert find_preset("openbmb/MiniCPM-V-4.7-1B").native


def test_replies_match_transformers_generate(manager_4_7, folder, conversations):
    """The engine lays out each prompt's canvas positions as the model's own generate() does."""
    from transformers import MiniCPMV4_7ForConditionalGeneration

    reference = MiniCPMV4_7ForConditionalGeneration.from_pretrained(folder)  # plain sdpa vision attention
    settings = greedy(REPLY_TOKENS)
    for key, messages in conversations.items():
        inputs = normalized_as_the_engine_does(manager_4_7.prepare(messages, settings).tensors)
        generated = reference.generate(**inputs, max_new_tokens=REPLY_TOKENS, min_new_tokens=REPLY_TOKENS,
                                     do_sample=False)
        expected = TextAssembler(manager_4_7.processor.tokenizer)
        for token in generated[0, inputs["input_ids"].shape[1]:].tolist():
            expected.add(token)
        assert reply(manager_4_7, messages, settings) == expected.text, key


def test_positions_matter_here(manager_4_7, conversations, monkeypatch):
    """Plain token-count positions give other replies to every conversation with media, so the match above is a
    real check."""
    settings = greedy(REPLY_TOKENS)
    with_media = [key for key in conversations if key != "text"]
    right = {key: reply(manager_4_7, conversations[key], settings) for key in with_media}
    monkeypatch.setattr("app.engine.core.canvas_positions", lambda model, tensors, mode: None)
    for key in with_media:
        assert reply(manager_4_7, conversations[key], settings) != right[key], key


def test_greedy_reply_is_the_same_alone_and_in_a_batch(manager_4_7, conversations):
    settings = greedy(24)
    alone = {key: reply(manager_4_7, messages, settings) for key, messages in conversations.items()}
    assert all_at_once(manager_4_7, conversations, settings) == alone
    assert len(set(alone.values())) == len(alone)
