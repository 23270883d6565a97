"""The reply's text from its tokens (app.engine.replies.TextAssembler), with the tiny model's byte-level BPE
tokenizer: the same text as decoding the whole reply, however the tokens arrive, at a cost per piece that
does not grow with the reply."""

import random

import pytest

from app.engine.replies import TextAssembler

TEXT = ("Un chat sur le toit, 屋根の上の猫 🐈‍⬛ — naïve café.\n\n"
        "```python\nprint('héllo')  # two  spaces\n```\n- 1 ✓\n- 2 ✗\n" * 3)


class CountingTokenizer:
    """The tokenizer, counting the token ids it is asked to decode."""

    def __init__(self, tokenizer):
        self.tokenizer, self.decoded = tokenizer, 0

    def decode(self, ids, **kwargs):
        self.decoded += len(ids)
        return self.tokenizer.decode(ids, **kwargs)


@pytest.fixture(scope="module")
def tokenizer(manager):
    return manager.processor.tokenizer


def in_pieces(ids: list[int], rng: random.Random) -> list[list[int]]:
    pieces, at = [], 0
    while at < len(ids):
        size = rng.choice((1, 1, 1, 2, 3, 7))
        pieces.append(ids[at:at + size])
        at += size
    return pieces


def test_text_arrives_whole_and_in_order_however_the_tokens_come(tokenizer):
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    assert tokenizer.decode(ids) == TEXT
    for seed in range(5):
        text = TextAssembler(tokenizer)
        shown = ""
        for piece in in_pieces(ids, random.Random(seed)):
            text.extend(piece)
            assert TEXT.startswith(text.text) and text.text.startswith(shown)  # no broken character shown
            shown = text.text
        assert text.text == TEXT and text.tokens == len(ids)


def test_random_tokens_give_what_decoding_the_whole_reply_gives(tokenizer):
    rng = random.Random(0)
    for _ in range(20):  # stray bytes of multi-byte characters and special tokens among them
        ids = [rng.randrange(len(tokenizer)) for _ in range(rng.randrange(1, 120))]
        text = TextAssembler(tokenizer)
        for piece in in_pieces(ids, rng):
            text.extend(piece)
        assert text.text == tokenizer.decode(ids, skip_special_tokens=True).rstrip("\ufffd")


def test_a_piece_costs_a_short_window_however_long_the_reply(tokenizer):
    ids = tokenizer.encode(TEXT.replace("\n", " ") * 4, add_special_tokens=False)  # no line breaks at all
    counting = CountingTokenizer(tokenizer)
    text = TextAssembler(counting)
    for token in ids:
        text.add(token)
    assert text.text == TEXT.replace("\n", " ") * 4
    assert counting.decoded < 8 * len(ids), (counting.decoded, len(ids))


def test_cut_keeps_the_text_before_it(tokenizer):
    ids = tokenizer.encode("Hello wörld. STOP and more 🐈", add_special_tokens=False)
    text = TextAssembler(tokenizer)
    text.extend(ids[:-1])  # the cat's last byte still to come
    text.cut(len("Hello wörld. "))
    assert text.text == "Hello wörld. " and text.tokens == len(ids) - 1
