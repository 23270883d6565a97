"""Conversations kept between turns (app.engine.conversations): a follow-up prefills only what is new, and its
greedy reply is the same, token for token, as with every prompt prefilled whole."""

import base64
import dataclasses

import pytest

from app.engine.conversations import ConversationCache
from app.engine.encoded_images import EncodedImages
from app.engine.settings import GenerationSettings
from tests.conftest import make_image, make_video

GREEDY = GenerationSettings(max_new_tokens=12, do_sample=False, enable_thinking=False)


@pytest.fixture
def cache(manager, monkeypatch):
    """Sets the session manager's conversation cache to one of `capacity` bytes (0: off), keeping prompts of
    `min_tokens` or more (the tiny model's prompts are shorter than the app's threshold), and its encoded images'
    to `images` bytes (unsaid: `capacity`)."""

    def use(capacity: int, min_tokens: int = 0, images: int | None = None) -> ConversationCache:
        kept = ConversationCache(capacity, min_tokens)
        monkeypatch.setattr(manager.scheduler, "conversations", kept)
        monkeypatch.setattr(manager.scheduler, "images", EncodedImages(capacity if images is None else images))
        return kept

    return use


def reply(manager, messages, settings=GREEDY):
    last = None
    for last in manager.stream(messages, settings):
        pass
    return last


def text(words: str) -> dict:
    return {"type": "text", "text": words}


def conversation(manager, first: list[dict], follow_ups: list[list[dict]], settings=GREEDY):
    """Each turn's (reply text, prompt tokens, reused prompt tokens): `first` the first question's parts,
    then each follow-up's, every reply put back into the conversation as the UI does."""
    messages, turns = [{"role": "user", "content": first}], []
    for parts in [None, *follow_ups]:
        if parts is not None:
            messages = messages + [{"role": "assistant", "content": [text(turns[-1][0])]},
                                   {"role": "user", "content": parts}]
        update = reply(manager, messages, settings)
        turns.append((update.text, update.stats["prompt_tokens"], update.stats["reused_prompt_tokens"]))
    return turns


def same_with_and_without(manager, cache, first, follow_ups, settings=GREEDY, capacity=2**30):
    cache(capacity)
    kept = conversation(manager, first, follow_ups, settings)
    cache(0)
    whole = conversation(manager, first, follow_ups, settings)
    assert [turn[0] for turn in kept] == [turn[0] for turn in whole]
    assert all(turn[2] == 0 for turn in whole)
    return kept


def test_a_follow_up_about_an_image_reuses_the_conversation_and_says_the_same(manager, cache, tmp_path):
    image = make_image(tmp_path, "photo.png", (900, 700))
    turns = same_with_and_without(manager, cache, [{"type": "image", "path": image}, text("What is it?")],
                                  [[text("And the colour?")], [text("Say it again.")]])
    assert turns[0][2] == 0
    for (_, before, _), (_, prompt, reused) in zip(turns, turns[1:]):
        # Everything before the previous prompt's generation prompt (its last few tokens) is reused: the image
        # and the earlier turns.
        assert before - 20 < reused < before < prompt and reused > 300


def test_thinking_on_and_a_new_image_in_a_later_turn(manager, cache, tmp_path):
    first, second = make_image(tmp_path, "a.png", (700, 500)), make_image(tmp_path, "b.png", (500, 700), (20, 200, 40))
    thinking = dataclasses.replace(GREEDY, enable_thinking=True)
    turns = same_with_and_without(manager, cache, [{"type": "image", "path": first}, text("What is it?")],
                                  [[{"type": "image", "path": second}, text("And this one?")], [text("Which is greener?")]],
                                  settings=thinking)
    assert 0 < turns[1][2] < turns[2][2]


def test_a_follow_up_about_a_video(manager, cache, tmp_path):
    video = make_video(tmp_path, seconds=2, fps=8)
    turns = same_with_and_without(manager, cache, [{"type": "video", "path": video}, text("What happens?")],
                                  [[text("And then?")]])
    assert turns[1][2] > 0


def test_an_evicted_conversation_is_prefilled_whole_with_the_same_reply(manager, cache, tmp_path):
    image = make_image(tmp_path, "photo.png", (900, 700))
    first = [{"type": "image", "path": image}, text("What is it?")]
    cache(2**30)
    kept = conversation(manager, first, [[text("More?")]])
    assert kept[1][2] > 0
    full = cache(2**30)
    conversation(manager, first, [])  # its state is kept...
    full.capacity_bytes = full.held_bytes
    full.keep(_one_turn_prompt(), _State(1))  # ...and let go for a newer one, as the least recently used
    assert len(full) == 1
    follow_up = [{"role": "user", "content": first}, {"role": "assistant", "content": [text(kept[0][0])]},
                 {"role": "user", "content": [text("More?")]}]
    update = reply(manager, follow_up)
    assert update.stats["reused_prompt_tokens"] == 0 and update.text == kept[1][0]


def test_the_least_recently_used_conversation_goes_first():
    kept = ConversationCache(3)
    for token in range(3):
        kept.keep(_one_turn_prompt(token), _State(1))
    assert kept.find(_one_turn_prompt(0)) is not None  # now the most recently used
    kept.keep(_one_turn_prompt(3), _State(1))
    assert [kept.find(_one_turn_prompt(token)) is not None for token in range(4)] == [True, False, True, True]
    assert kept.held_bytes == 3
    kept.keep(_one_turn_prompt(4), _State(4))  # larger than the whole cache: not kept, nothing let go
    assert len(kept) == 3


def test_conversations_are_matched_by_their_media_and_every_token(manager, cache, tmp_path):
    red, blue = make_image(tmp_path, "red.png", (600, 600)), make_image(tmp_path, "blue.png", (600, 600), (20, 20, 200))
    cache(2**30)
    turns = conversation(manager, [{"type": "image", "path": red}, text("What is it?")], [])
    # Same words, same size, another file: nothing of the red one's conversation is reused.
    other = conversation(manager, [{"type": "image", "path": blue}, text("What is it?")], [[text("Sure?")]])
    assert other[0][2] == 0 and other[1][2] > 0
    # The same question again (Retry): up to its reply, all of it.
    again = conversation(manager, [{"type": "image", "path": red}, text("What is it?")], [])
    assert again[0][0] == turns[0][0] and 0 < again[0][2] < again[0][1]


def test_a_prompt_too_short_to_keep_is_prefilled_whole_and_not_kept(manager, cache):
    """Below the cache's min_tokens a prompt is prefilled whole and nothing of it kept; once its conversation
    has grown past it, its state is kept and the next turn goes on from it, with the same greedy replies."""
    first, follow_ups = [text("Tell me a story.")], [[text("More?")], [text("And then?")]]
    cache(0)
    whole = conversation(manager, first, follow_ups)
    kept = cache(2**30, min_tokens=whole[0][1])  # past the first prompt's last turn, before the second's
    turns = conversation(manager, first, follow_ups)
    assert [turn[0] for turn in turns] == [turn[0] for turn in whole]
    assert turns[0][2] == turns[1][2] == 0 and turns[2][2] > whole[0][1]
    assert len(kept) == 2  # the second turn's state and the third's: none of the first


def test_the_cache_turns_off(manager, monkeypatch):
    from app import tuning

    monkeypatch.setattr(tuning, "CONVERSATION_CACHE", 0)
    assert not manager._conversation_cache().enabled
    monkeypatch.setattr(tuning, "CONVERSATION_CACHE", 1)
    monkeypatch.setattr(tuning, "CONVERSATION_CACHE_GB", 0.5)
    monkeypatch.setattr(tuning, "CONVERSATION_CACHE_MIN_TOKENS", 300)
    built = manager._conversation_cache()
    assert built.capacity_bytes == 2**29 and built.min_tokens == 300


def test_the_cache_is_sized_from_the_gpus_memory_unless_set(manager, monkeypatch):
    import torch

    from app import tuning

    assert tuning.CONVERSATION_CACHE_GB < 0 and tuning.CONVERSATION_CACHE_SHARE == 0.12  # left to the app
    assert manager._conversation_cache().capacity_bytes == 4 * 2**30  # the CPU
    monkeypatch.setattr(type(manager), "_on_cuda", property(lambda self: True))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: type("H200", (), {"total_memory": 141 * 10**9}))
    assert manager._conversation_cache().capacity_bytes == int(tuning.CONVERSATION_CACHE_SHARE * (141 * 10**9))
    monkeypatch.setattr(tuning, "CONVERSATION_CACHE_GB", 2.0)
    assert manager._conversation_cache().capacity_bytes == 2 * 2**30


def test_the_api_reports_the_cached_tokens_of_a_follow_up(manager, cache, server_url, tmp_path):
    from openai import OpenAI

    cache(2**30)
    api = OpenAI(base_url=server_url + "v1", api_key="unused")
    image = open(make_image(tmp_path, "photo.jpg", (800, 600)), "rb").read()
    url = "data:image/jpeg;base64," + base64.b64encode(image).decode()
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}, text("What is it?")]}]
    first = api.chat.completions.create(model="tiny-random", messages=messages, max_tokens=8, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    messages += [{"role": "assistant", "content": first.choices[0].message.content}, {"role": "user", "content": "More?"}]
    second = api.chat.completions.create(model="tiny-random", messages=messages, max_tokens=8, temperature=0)
    before = first.usage.prompt_tokens
    assert before - 20 < second.usage.prompt_tokens_details.cached_tokens < before < second.usage.prompt_tokens


@dataclasses.dataclass
class _State:
    nbytes: int


def _one_turn_prompt(token: int = 0):
    """A prepared prompt of two tokens, its last turn starting at the second."""
    import torch

    from app.engine.inputs import PreparedInputs

    return PreparedInputs(tensors={"input_ids": torch.tensor([[token, 7]])}, prompt_tokens=2, turn_starts=(0, 1))


@pytest.mark.parametrize("between_powers_of_two", [False, True])
def test_the_padded_continued_prefill_matches_the_packed_one(manager, between_powers_of_two):
    """What a captured graph runs (prompts padded at their end, on the device) against the launched path: at a
    generation prompt's length, and at the first captured length that is no power of two (a chat reply's turn,
    its padding across chunks of 64 tokens)."""
    import torch

    from app.model.continued_graphs import CONTINUED_GRAPH_LENGTHS

    length = next(size for size in CONTINUED_GRAPH_LENGTHS[2] if size & (size - 1)) if between_powers_of_two else 16
    tail_lengths = (length - 62, length - 35) if between_powers_of_two else (2, 11)  # one inside the conv's window

    runner, fused = manager.runner, manager.runner.text.fused
    store = runner.store
    embed = fused.embed
    generator = torch.Generator().manual_seed(0)
    heads = [torch.randint(0, embed.num_embeddings, (1, n), generator=generator) for n in (40, 23)]
    tails = [torch.randint(0, embed.num_embeddings, (1, n), generator=generator) for n in tail_lengths]
    columns = 40 + length
    with torch.inference_mode():
        runner.prefill([(ids, None, None) for ids in heads], 0, columns)
        snapshots = runner.snapshots([0, 1], [ids.shape[1] for ids in heads])
        packed = runner.prefill_continued([(ids, None) for ids in tails], [40, 23], [0, 1], columns)
        after_packed = runner.snapshots([0, 1], [40 + tail_lengths[0], 23 + tail_lengths[1]])
        runner.restore(snapshots, [2, 3], columns)
        embeddings = torch.zeros((2 * length, embed.embedding_dim), dtype=embed.weight.dtype)
        for row, ids in enumerate(tails):
            embeddings[row * length:row * length + ids.shape[1]] = embed(ids)[0]
        padded = fused.prefill_continued_padded(embeddings, torch.tensor(tail_lengths), torch.tensor([40, 23]),
                                                torch.tensor([2, 3]), store.column_capacity)
    torch.testing.assert_close(padded, packed, rtol=1e-4, atol=1e-4)
    for slot, expected in enumerate(after_packed):
        for layer, state in expected.recurrent.items():
            torch.testing.assert_close(store.recurrent[layer][slot + 2], state, rtol=1e-4, atol=1e-4)
        for layer, state in expected.conv.items():
            torch.testing.assert_close(store.conv[layer][slot + 2], state)
        for layer, keys in expected.keys.items():
            torch.testing.assert_close(store.keys[layer][slot + 2, :, :keys.shape[1]], keys)
    runner.release()


@pytest.mark.parametrize("kinds", [("jpg", "jpg"), ("png", "png"), ("png", "jpg")])
def test_a_kept_conversation_drops_its_images_pixels_or_jpegs(manager, tmp_path, kinds):
    """Whether its images come as pixels, as JPEGs the engine decodes on its GPU or as pixels its preparer
    decoded for the engine to slice, a follow-up keeps only what comes after the kept part: the later image's
    pixels (or JPEG) and slice sizes."""
    from app.engine.conversations import without_media_before
    from app.engine.inputs import prepare_inputs
    from app.engine.jpegs_on_device import DECODED_PIXELS, DEFERRED_IMAGES
    from app.model.jpegs import CPU, slices

    first = make_image(tmp_path, f"a.{kinds[0]}", (700, 500))
    second = make_image(tmp_path, f"b.{kinds[1]}", (300, 200), (9, 9, 200))
    messages = [{"role": "user", "content": [{"type": "image", "path": first}, text("What?")]},
                {"role": "assistant", "content": [text("A red field.")]},
                {"role": "user", "content": [{"type": "image", "path": second}, text("And this?")]}]
    alone = prepare_inputs(manager.processor, messages[2:], GREEDY, 32768)
    for on_device in (False, True):
        prepared = prepare_inputs(manager.processor, messages, GREEDY, 32768, jpegs_on_device=on_device)
        kept = prepared.turn_starts[-2]  # where the second question's turn starts: after the first image
        assert prepared.media_ends[0] <= kept < prepared.media_ends[1]
        without_media_before(prepared, kept)
        assert prepared.tensors["target_sizes"].tolist() == alone.tensors["target_sizes"].tolist()
        if on_device:
            rest = prepared.tensors[DEFERRED_IMAGES]
            assert rest.paths == (second,)
            assert (DECODED_PIXELS in prepared.tensors) == (kinds[1] == "png")
            made = slices(rest, CPU, pixels=prepared.tensors.get(DECODED_PIXELS))
            assert made.equal(alone.tensors["pixel_values"])
        else:
            assert prepared.tensors["pixel_values"].equal(alone.tensors["pixel_values"])


def test_a_follow_up_decodes_none_of_the_images_its_conversation_holds(manager, cache, tmp_path, monkeypatch):
    from app.engine import inputs

    decoded = []
    load = inputs.load_image_pixels
    monkeypatch.setattr(inputs, "load_image_pixels", lambda path, *rest: decoded.append(path) or load(path, *rest))
    photo, other = make_image(tmp_path, "photo.png", (900, 700)), make_image(tmp_path, "other.png", (500, 400), (1, 2, 3))
    turns = same_with_and_without(manager, cache, [{"type": "image", "path": photo}, text("What is it?")],
                                  [[text("And the colour?")], [{"type": "image", "path": other}, text("And this?")]])
    assert turns[1][2] > 0 and turns[2][2] > turns[1][2]
    # With the cache: once for its first turn, not for the text follow-up, and again with a new image beside it
    # (a request decodes all its images or none); without: every turn.
    assert decoded.count(photo) == 2 + 3 and decoded.count(other) == 1 + 1


def test_a_conversation_let_go_while_its_follow_up_is_prepared_is_prepared_again_with_its_pixels(manager, cache, tmp_path):
    photo = make_image(tmp_path, "photo.png", (900, 700))
    first = [{"type": "image", "path": photo}, text("What is it?")]
    kept = cache(2**30, images=0)  # no features of its image kept either
    answer = conversation(manager, first, [])[0][0]
    follow_up = [{"role": "user", "content": first}, {"role": "assistant", "content": [text(answer)]},
                 {"role": "user", "content": [text("More?")]}]
    kept.find = lambda prepared: None  # held when the preparer was told, gone when it is looked for
    prepared = manager.prepare(follow_up, GREEDY)
    assert not prepared.pixels_left_out and prepared.tensors["pixel_values"] is not None and prepared.kept is None
    update = reply(manager, follow_up)
    cache(0)
    assert update.text == reply(manager, follow_up).text and update.stats["reused_prompt_tokens"] == 0


def test_no_room_to_keep_a_conversation_leaves_the_reply_as_it_is(manager, cache, tmp_path, monkeypatch):
    import torch

    def no_room(slots, columns):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory (a test's)")

    photo = make_image(tmp_path, "photo.png", (900, 700))
    first = [{"type": "image", "path": photo}, text("What is it?")]
    cache(0)
    whole = conversation(manager, first, [[text("More?")]])
    kept = cache(2**30)
    monkeypatch.setattr(manager.runner.store, "snapshots", no_room)
    assert conversation(manager, first, [[text("More?")]]) == whole and len(kept) == 0
