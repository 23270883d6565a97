"""The conversation cache (app.engine.conversations) in a wave that mixes every kind of prompt, through /ask, over
a model's unload, under a prompt of thousands of turns, and with another user's image."""

import threading

import pytest

from app.engine import scheduler as scheduler_module
from app.engine.conversations import ConversationCache
from app.engine.settings import GenerationSettings
from tests.conftest import make_image
from tests.test_conversations import GREEDY, cache, conversation, reply, text  # noqa: F401 (cache: a fixture)


def _in_one_wave(manager, prompts, settings, monkeypatch):
    """Each prompt's reply, all of them admitted together (the scheduler paused while they are put in line),
    and the sizes of the waves prefill_wave was given."""
    waves = []
    real = scheduler_module.prefill_wave

    def recording(runner, cache, wave, *rest):
        waves.append(len(wave))
        return real(runner, cache, wave, *rest)

    monkeypatch.setattr(scheduler_module, "prefill_wave", recording)
    assert manager.scheduler.pause(30)
    results = [None] * len(prompts)
    try:
        def run(index):
            results[index] = reply(manager, prompts[index], settings)

        threads = [threading.Thread(target=run, args=(index,)) for index in range(len(prompts))]
        for thread in threads:
            thread.start()
        for _ in range(200):
            if manager.scheduler.waiting == len(prompts):
                break
            threading.Event().wait(0.05)
    finally:
        manager.scheduler.resume()
    for thread in threads:
        thread.join(120)
    return [update.text for update in results], [update.stats["reused_prompt_tokens"] for update in results], waves


@pytest.mark.parametrize("min_tokens", [0, 100])
def test_a_wave_of_every_kind_says_what_prompts_prefilled_whole_say(manager, cache, tmp_path, monkeypatch, min_tokens):
    """A follow-up with a new image, a text follow-up, a Retry, the same image sent again in a new turn and a
    new conversation, prefilled in one wave: each reply as with every prompt prefilled whole, greedy. With
    min_tokens 100 the text conversation (a few dozen tokens) is too short to keep: the wave mixes a prompt
    prefilled whole with those kept and those going on."""
    a, b, c, d = (make_image(tmp_path, f"{name}.png", size, color) for name, size, color in
                  (("a", (900, 700), (200, 30, 30)), ("b", (500, 400), (20, 200, 30)),
                   ("c", (640, 480), (30, 30, 200)), ("d", (300, 600), (120, 120, 0))))
    settings = GenerationSettings(max_new_tokens=10, do_sample=False, enable_thinking=False, repetition_penalty=1.3)
    firsts = [[{"type": "image", "path": a}, text("What is it?")], [text("Tell me a story.")],
              [{"type": "image", "path": c}, text("Describe it.")], [{"type": "image", "path": b}, text("Colour?")]]
    cache(2**30, min_tokens)
    answers = [conversation(manager, first, [], settings)[0][0] for first in firsts]

    def follow_up(index, parts):
        return [{"role": "user", "content": firsts[index]}, {"role": "assistant", "content": [text(answers[index])]},
                {"role": "user", "content": parts}]

    prompts = [follow_up(0, [{"type": "image", "path": b}, text("And this one?")]),
               follow_up(1, [text("Go on.")]),
               [{"role": "user", "content": firsts[2]}],  # Retry
               follow_up(3, [{"type": "image", "path": b}, text("Again: colour?")]),  # the same image again
               [{"role": "user", "content": [{"type": "image", "path": d}, text("What is it?")]}]]
    kept_texts, reused, waves = _in_one_wave(manager, prompts, settings, monkeypatch)
    assert max(waves) >= 4  # they went together
    assert reused[0] > 0 and reused[2] > 0 and reused[4] == 0
    assert (reused[1] > 0) == (min_tokens == 0)
    cache(0)
    whole = [reply(manager, prompt, settings).text for prompt in prompts]
    assert kept_texts == whole


def test_a_model_unloaded_lets_its_kept_conversations_go(tmp_path, monkeypatch):
    """Its states are the old model's, on the GPU the next model's load needs."""
    from app import tuning
    from app.config import AppConfig
    from app.engine.backends import load_manager

    monkeypatch.setattr(tuning, "CONVERSATION_CACHE_MIN_TOKENS", 0)  # the tiny model's prompt is shorter
    own = load_manager(AppConfig(model="tiny-random", port=0, max_new_tokens=64, engine_process=False, warmup=False))
    photo = make_image(tmp_path, "photo.png", (600, 500))
    conversation(own, [{"type": "image", "path": photo}, text("What is it?")], [])
    assert len(own.scheduler.conversations) == 1
    own._unload()
    assert len(own.scheduler.conversations) == 0, "the unloaded model's kept states are still held"


def test_a_conversations_older_states_go_before_its_latest(manager, cache, tmp_path):
    """Each turn keeps a state; the older ones (an Undo's, an edit's) are let go first when room is needed."""
    kept = cache(2**30)
    photo = make_image(tmp_path, "photo.png", (900, 700))
    first = [{"type": "image", "path": photo}, text("What is it?")]
    turns = conversation(manager, first, [[text("More?")], [text("And?")]], GREEDY)
    assert len(kept) == 3
    kept.capacity_bytes = kept.held_bytes
    kept.keep(_one_turn_prompt(), _Bytes(1))  # one state must go: the first turn's, the least wanted
    assert len(kept) == 3
    answers = [{"role": "assistant", "content": [text(answer)]} for answer, _, _ in turns]
    follow_up = [{"role": "user", "content": first}, answers[0], {"role": "user", "content": [text("More?")]},
                 answers[1], {"role": "user", "content": [text("And?")]}, answers[2],
                 {"role": "user", "content": [text("Then?")]}]
    assert reply(manager, follow_up).stats["reused_prompt_tokens"] > turns[2][1] - 20  # the latest still kept
    undo = follow_up[:1] + [{"role": "assistant", "content": [text(turns[0][0])]}, {"role": "user", "content": [text("Why?")]}]
    assert reply(manager, undo).stats["reused_prompt_tokens"] == 0  # the first turn's was let go


def _one_turn_prompt():
    import torch

    from app.engine.inputs import PreparedInputs

    return PreparedInputs(tensors={"input_ids": torch.tensor([[5, 6]])}, prompt_tokens=2, turn_starts=(0, 1))


def test_looking_up_a_prompt_of_many_turns_does_not_hold_up_the_scheduler():
    """The scheduler's thread takes the cache's lock in keep() in every prefill wave: looking up a prompt of
    ~4,500 one-word turns (it fits the context, so it is accepted) must not hold it (it held it 0.15 s when
    every turn start's key was made under it)."""
    import time

    import torch

    from app.engine.inputs import PreparedInputs

    tokens = 32000
    starts = tuple(range(1, tokens, 7))  # a turn every 7 tokens: "<|im_start|>user\nx<|im_end|>\n"
    crafted = PreparedInputs(tensors={"input_ids": torch.randint(0, 1000, (1, tokens))}, prompt_tokens=tokens,
                             turn_starts=starts)
    kept = ConversationCache(10)
    kept.keep(PreparedInputs(tensors={"input_ids": torch.tensor([[1, 2]])}, prompt_tokens=2, turn_starts=(0, 1)),
              _Bytes(1))
    looking = threading.Thread(target=kept.find, args=(crafted,))
    looking.start()
    threading.Event().wait(0.005)
    started = time.perf_counter()
    kept.keep(PreparedInputs(tensors={"input_ids": torch.tensor([[3, 4]])}, prompt_tokens=2, turn_starts=(0, 1)),
              _Bytes(1))  # what the scheduler's thread does after a prompt's head is prefilled
    waited = time.perf_counter() - started
    looking.join()
    assert waited < 0.02, f"the scheduler's keep() waited {waited:.3f} s for one request's find()"


class _Bytes:
    def __init__(self, nbytes: int):
        self.nbytes = nbytes


def test_an_ask_follow_up_goes_on_from_its_kept_conversation(client, manager, cache, tmp_path):
    """/ask's follow_up (the scripting API's conversation, as the UI tabs keep theirs): its images come back as
    the paths of the first turn, so the follow-up reuses what the first turn kept."""
    from tests.test_api import FIXED, stream

    cache(2**30)
    photo = make_image(tmp_path, "photo.png", (900, 700))
    _, (_, first) = stream(client, "What colour is it?", [photo], FIXED)
    _, (_, second) = stream(client, "Are you sure?", [], {**FIXED, "follow_up": True})
    assert first["reused_prompt_tokens"] == 0
    assert second["reused_prompt_tokens"] > first["prompt_tokens"] - 20, (first, second)


def test_another_users_image_in_a_first_question_costs_no_second_preparation(manager, cache, tmp_path, monkeypatch):
    """An image of the last question is never taken as held (no kept state of its own conversation can hold it):
    one another user's conversation holds is decoded at once, and how long that took tells nothing."""
    cache(2**30)
    shared = make_image(tmp_path, "api-same-bytes.png", (900, 700))
    conversation(manager, [{"type": "image", "path": shared}, text("Someone's private question")], [])
    calls = []
    real = manager.preparer.prepare
    monkeypatch.setattr(manager.preparer, "prepare", lambda *a, **k: calls.append(k["kept_media"]) or real(*a, **k))
    manager.prepare([{"role": "user", "content": [{"type": "image", "path": shared}, text("What is it?")]}], GREEDY)
    assert len(calls) == 1, f"prepared {len(calls)} times because another conversation holds the image"


def test_an_edited_earlier_turn_and_a_system_prompt_say_what_whole_prompts_say(manager, cache, tmp_path):
    """A system prompt, then an earlier turn edited (the prompt goes on from an older kept state): greedy replies
    as with every prompt prefilled whole."""
    photo = make_image(tmp_path, "photo.png", (900, 700))
    system = {"role": "system", "content": [text("You answer briefly.")]}
    first = {"role": "user", "content": [{"type": "image", "path": photo}, text("What is it?")]}

    def run():
        one = reply(manager, [system, first])
        two_messages = [system, first, {"role": "assistant", "content": [text(one.text)]},
                        {"role": "user", "content": [text("More?")]}]
        two = reply(manager, two_messages)
        edited = two_messages[:3] + [{"role": "user", "content": [text("Less?")]}]
        three = reply(manager, edited)
        return [one.text, two.text, three.text], [one.stats["reused_prompt_tokens"], two.stats["reused_prompt_tokens"],
                                                  three.stats["reused_prompt_tokens"]]

    cache(2**30)
    kept, reused = run()
    cache(0)
    whole, _ = run()
    assert kept == whole and reused[0] == 0 and reused[1] > 0 and reused[2] == reused[1]
