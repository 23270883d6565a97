"""Earlier turns' images kept encoded (app.engine.encoded_images): a conversation whose kept state is gone, or that
starts again from its first turn, neither decodes nor encodes its images again, and its greedy reply is the same,
token for token, as with every image decoded and encoded anew."""

from types import SimpleNamespace

import pytest

from app.engine.conversations import ConversationCache, file_identity
from app.engine.encoded_images import EncodedImages, held_media
from app.engine.settings import GenerationSettings
from tests.conftest import make_image

GREEDY = GenerationSettings(max_new_tokens=12, do_sample=False, enable_thinking=False)


@pytest.fixture
def work(manager, monkeypatch, tmp_path):
    """The session manager with no conversations kept and encoded images kept up to `capacity` bytes (set by
    use(capacity)), counting each image file decoded and each image slice encoded."""
    from app.engine import inputs

    counts = SimpleNamespace(decoded=[], slices=0)
    load = inputs.load_image_pixels
    monkeypatch.setattr(inputs, "load_image_pixels", lambda path, *rest: counts.decoded.append(path) or load(path, *rest))
    encode = manager.runner._slice_features

    def counted(pixels, sizes, mode):
        counts.slices += len(sizes)
        return encode(pixels, sizes, mode)

    monkeypatch.setattr(manager.runner, "_slice_features", counted)
    monkeypatch.setattr(manager.scheduler, "conversations", ConversationCache(0))

    def use(capacity: int) -> EncodedImages:
        images = EncodedImages(capacity)
        monkeypatch.setattr(manager.scheduler, "images", images)
        counts.decoded.clear()
        counts.slices = 0
        return images

    counts.use = use
    return counts


def reply(manager, messages):
    last = None
    for last in manager.stream(messages, GREEDY):
        pass
    return last


def user(*parts) -> dict:
    return {"role": "user", "content": [{"type": "image", "path": part} if part.endswith((".png", ".jpg")) else
                                        {"type": "text", "text": part} for part in parts]}


def assistant(words: str) -> dict:
    return {"role": "assistant", "content": [{"type": "text", "text": words}]}


def started_again(manager, photo: str) -> list[str]:
    """A first question about `photo`, then two follow-ups, each a new branch from the first answer (a
    conversation started again from its first turn)."""
    first = [user(photo, "What is it?")]
    answer = reply(manager, first).text
    return [answer] + [reply(manager, first + [assistant(answer), user(question)]).text
                       for question in ("And the colour?", "And the shape?")]


def test_a_conversation_started_again_neither_decodes_nor_encodes_its_image_again(manager, work, tmp_path):
    photo = make_image(tmp_path, "photo.png", (900, 700))
    work.use(0)
    anew = started_again(manager, photo)
    assert work.decoded.count(photo) == 3
    slices = work.slices // 3
    assert slices > 1  # a source view and its slices: each turn encoded them all
    images = work.use(2**30)
    assert started_again(manager, photo) == anew
    assert work.decoded.count(photo) == 1 and work.slices == slices
    assert len(images) == 1 and images.held_bytes > 0
    first = [user(photo, "What is it?")]
    stats = reply(manager, first + [assistant(anew[0]), user("And the size?")]).stats
    assert stats["reused_image_tokens"] == stats["visual_tokens"] > 0 and stats["reused_prompt_tokens"] == 0
    assert reply(manager, first).stats["reused_image_tokens"] == 0  # the last question's image: encoded anew


def test_an_image_of_the_last_question_is_always_decoded_and_encoded(manager, work, tmp_path):
    """As for kept conversations (docs/SECURITY.md): the time a first question takes never tells whether
    someone sent that file before."""
    photo = make_image(tmp_path, "photo.png", (900, 700))
    work.use(2**30)
    first = reply(manager, [user(photo, "What is it?")]).text
    assert reply(manager, [user(photo, "What is it?")]).text == first
    assert work.decoded.count(photo) == 2 and work.slices % 2 == 0 and work.slices > 2


def test_an_image_let_go_is_decoded_and_encoded_again_with_the_same_reply(manager, work, tmp_path):
    photo, other = make_image(tmp_path, "photo.png", (900, 700)), make_image(tmp_path, "other.png", (500, 400), (1, 2, 3))
    work.use(0)
    anew = started_again(manager, photo)
    images = work.use(2**30)
    first = [user(photo, "What is it?")]
    reply(manager, first)
    reply(manager, [user(other, "And this?")])
    images.capacity_bytes = images.held_bytes  # the next image kept lets the photo's, the least recently used, go
    reply(manager, [user(make_image(tmp_path, "third.png", (300, 200)), "And a third?")])
    held = images.held({file_identity(photo), file_identity(other)})
    assert not any(key.startswith(photo) for key in held) and any(key.startswith(other) for key in held)
    work.decoded.clear()
    follow_up = reply(manager, first + [assistant(anew[0]), user("And the colour?")])
    assert follow_up.text == anew[1] and work.decoded.count(photo) == 1


def two_images_asked_about(manager, work, tmp_path):
    """(photo, other, the first question about the photo, its answer, the second about the other, its answer), the
    answers with no images kept."""
    photo, other = make_image(tmp_path, "photo.png", (900, 700)), make_image(tmp_path, "other.png", (500, 400), (1, 2, 3))
    first = [user(photo, "What is it?")]
    work.use(0)
    answer = reply(manager, first).text
    second = first + [assistant(answer), user(other, "And this?")]
    return photo, other, first, answer, second, reply(manager, second).text


def test_a_new_image_beside_held_ones_decodes_and_encodes_them_all(manager, work, tmp_path):
    """A request decodes all its images or none; each one's features are then kept again."""
    photo, other, first, answer, second, anew = two_images_asked_about(manager, work, tmp_path)
    third = second + [assistant(anew), user("Which is bluer?")]
    last = reply(manager, third).text
    images = work.use(2**30)
    assert reply(manager, first).text == answer and reply(manager, second).text == anew
    assert work.decoded.count(photo) == 2 and work.decoded.count(other) == 1 and len(images) == 2
    work.decoded.clear()
    work.slices = 0
    assert reply(manager, third).text == last  # both held now: neither decoded, taken in the prompt's order
    assert work.decoded == [] and work.slices == 0
    # The other way round, the same two features in the other order: the same reply as with both decoded.
    swapped = [user(other, "What is it?"), assistant(answer), user(photo, "And this?"), assistant(anew),
               user("Which is bluer?")]
    images.clear()
    anew_swapped = reply(manager, swapped).text
    reply(manager, swapped[:1])
    reply(manager, swapped[:3])
    work.decoded.clear()
    work.slices = 0
    assert reply(manager, swapped).text == anew_swapped and work.decoded == [] and work.slices == 0


def test_a_kept_conversation_holding_one_image_and_kept_features_the_other(manager, work, monkeypatch, tmp_path):
    """An edited earlier answer: only the state kept before it matches, holding the first image; the second, of a
    later turn, comes from the kept features. The reply is the one with nothing kept."""
    photo, other, first, answer, second, answer2 = two_images_asked_about(manager, work, tmp_path)
    edited = first + [assistant(answer + " (edited)"), user(other, "And this?"), assistant(answer2), user("Which is bluer?")]
    anew = reply(manager, edited).text
    work.use(2**30)
    monkeypatch.setattr(manager.scheduler, "conversations", ConversationCache(2**30))
    reply(manager, first)
    reply(manager, second)
    work.decoded.clear()
    update = reply(manager, edited)
    assert update.text == anew and update.stats["reused_prompt_tokens"] > 0 and work.decoded == []


def test_a_preparer_is_told_only_the_held_images_its_request_may_take(manager, work, tmp_path):
    photo, other = make_image(tmp_path, "photo.png", (900, 700)), make_image(tmp_path, "other.png", (500, 400), (1, 2, 3))
    images = work.use(2**30)
    reply(manager, [user(photo, "What is it?")])
    reply(manager, [user(other, "What is it?")])
    conversations = manager.scheduler.conversations
    follow_up = [user(photo, "What is it?"), assistant("A photo."), user("More?")]
    assert held_media(follow_up, conversations, images) == images.held({file_identity(photo)}) != frozenset()
    assert not any(other in key for key in held_media(follow_up, conversations, images))
    # None where the last question holds an image (every image is then decoded), or no earlier turn does.
    assert held_media(follow_up[:2] + [user(other, "And this?")], conversations, images) == frozenset()
    assert held_media([user("Hello")], conversations, images) == frozenset()


def test_turning_kept_conversations_off_keeps_no_images_either(manager, monkeypatch):
    from app import tuning

    assert manager._encoded_images().capacity_bytes == tuning.ENCODED_IMAGES_MB * 2**20 > 0
    monkeypatch.setattr(tuning, "ENCODED_IMAGES_MB", 0)
    assert not manager._encoded_images().enabled
    monkeypatch.setattr(tuning, "ENCODED_IMAGES_MB", 1024)
    monkeypatch.setattr(tuning, "CONVERSATION_CACHE", 0)
    assert not manager._encoded_images().enabled


def test_features_let_go_while_a_request_is_prepared_are_decoded_after_all(manager, work, tmp_path):
    photo = make_image(tmp_path, "photo.png", (900, 700))
    images = work.use(2**30)
    first = [user(photo, "What is it?")]
    answer = reply(manager, first).text
    images.take = lambda keys, rows: None  # held when the preparer was told, gone when taken
    prepared = manager.prepare(first + [assistant(answer), user("More?")], GREEDY)
    assert not prepared.pixels_left_out and prepared.image_features is None
    assert prepared.tensors.get("pixel_values") is not None or prepared.tensors.get("images_for_the_device")


def test_the_least_recently_used_features_go_first():
    class Features:
        nbytes, shape = 10, (5, 2)

    images = EncodedImages(25)
    first, second, third = Features(), Features(), Features()
    images.keep("/a.png|1|9|16x|9", first)
    images.keep("/b.png|2|9|16x|9", second)
    assert images.take(["/a.png|1|9|16x|9"], [5]) == [first]  # now the most recently used
    images.keep("/a.png|1|9|16x|2", third)  # the same file cut otherwise: a key of its own
    every = {"/a.png|1|9", "/b.png|2|9"}
    assert images.held(every) == {"/a.png|1|9|16x|9", "/a.png|1|9|16x|2"} and images.held_bytes == 20
    assert images.held({"/b.png|2|9"}) == frozenset()
    assert images.take(["/a.png|1|9|16x|9", "/b.png|2|9|16x|9"], [5, 5]) is None
    assert images.take(["/a.png|1|9|16x|9"], [4]) is None  # not of the visual tokens its request says
    assert images.take(["/a.png|1|9|16x|2", "/a.png|1|9|16x|9"], [5, 5]) == [third, first]
    big = type("Big", (), {"nbytes": 26, "shape": (13, 2)})()
    images.keep("/c.png|3|9|16x|9", big)  # larger than the whole cache: not kept
    assert images.held(every | {"/c.png|3|9"}) == {"/a.png|1|9|16x|9", "/a.png|1|9|16x|2"}
    images.clear()
    assert len(images) == 0 and images.held_bytes == 0 and images.held(every) == frozenset()


def test_an_out_of_memory_or_an_unload_lets_every_kept_image_go(manager, work, tmp_path):
    images = work.use(2**30)
    photo = make_image(tmp_path, "photo.png", (900, 700))
    reply(manager, [user(photo, "What is it?")])
    assert len(images) == 1
    manager.scheduler.forget_kept()
    assert len(images) == 0
