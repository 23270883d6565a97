"""Earlier turns' images kept encoded (app.engine.encoded_images): a conversation whose kept state is gone, or that
starts again from its first turn, neither decodes nor encodes its images again, and its greedy reply is the same,
token for token, as with every image decoded and encoded anew."""

from types import SimpleNamespace

import pytest

from app.engine.conversations import ConversationCache
from app.engine.encoded_images import EncodedImages
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
    assert not any(key.startswith(photo) for key in images.held()) and any(key.startswith(other) for key in images.held())
    work.decoded.clear()
    follow_up = reply(manager, first + [assistant(anew[0]), user("And the colour?")])
    assert follow_up.text == anew[1] and work.decoded.count(photo) == 1


def test_a_new_image_beside_held_ones_decodes_and_encodes_them_all(manager, work, tmp_path):
    """A request decodes all its images or none; each one's features are then kept again."""
    photo, other = make_image(tmp_path, "photo.png", (900, 700)), make_image(tmp_path, "other.png", (500, 400), (1, 2, 3))
    first = [user(photo, "What is it?")]
    work.use(0)
    answer = reply(manager, first).text
    second = first + [assistant(answer), user(other, "And this?")]
    anew = reply(manager, second).text
    images = work.use(2**30)
    assert reply(manager, first).text == answer and reply(manager, second).text == anew
    assert work.decoded.count(photo) == 2 and work.decoded.count(other) == 1 and len(images) == 2
    work.decoded.clear()
    third = second + [assistant(anew), user("Which is bluer?")]
    reply(manager, third)
    assert work.decoded == []  # both held now: neither decoded


def test_features_let_go_while_a_request_is_prepared_are_decoded_after_all(manager, work, tmp_path):
    photo = make_image(tmp_path, "photo.png", (900, 700))
    images = work.use(2**30)
    first = [user(photo, "What is it?")]
    answer = reply(manager, first).text
    images.take = lambda keys: None  # held when the preparer was told, gone when taken
    prepared = manager.prepare(first + [assistant(answer), user("More?")], GREEDY)
    assert not prepared.pixels_left_out and prepared.image_features is None
    assert prepared.tensors.get("pixel_values") is not None or prepared.tensors.get("images_for_the_device")


def test_the_least_recently_used_features_go_first():
    class Features:
        nbytes = 10

    images = EncodedImages(25)
    first, second, third = Features(), Features(), Features()
    images.keep("a", first)
    images.keep("b", second)
    assert images.take(["a"]) == [first]  # now the most recently used
    images.keep("c", third)
    assert images.held() == {"a", "c"} and images.held_bytes == 20
    assert images.take(["a", "b"]) is None and images.take(["c", "a"]) == [third, first]
    images.keep("big", type("Big", (), {"nbytes": 26})())  # larger than the whole cache: not kept
    assert images.held() == {"a", "c"}
    images.clear()
    assert len(images) == 0 and images.held_bytes == 0


def test_an_out_of_memory_or_an_unload_lets_every_kept_image_go(manager, work, tmp_path):
    images = work.use(2**30)
    photo = make_image(tmp_path, "photo.png", (900, 700))
    reply(manager, [user(photo, "What is it?")])
    assert len(images) == 1
    manager.scheduler.forget_kept()
    assert len(images) == 0
