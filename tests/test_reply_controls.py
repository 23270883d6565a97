"""What a request can ask of its reply beyond the decoding settings, on the CPU: stop texts end it (in the
engine, which then frees its slot), a seed makes sampled draws repeat whatever the batch, the reply says why
it ended, and a system message survives the trimming of old turns."""

import threading

import pytest
import torch

from app.config import AppConfig
from app.engine.api import ReplyEvent
from app.engine.metrics import EngineMetrics
from app.engine.openai_backend import OpenAIEngine
from app.engine.request import Request
from app.engine.scheduler import Scheduler
from app.engine.settings import GenerationSettings, RowSettings
from app.model.sampling import next_tokens
from tests.conftest import make_image, wait_for
from tests.test_api import stream
from tests.test_engine_process import reply
from tests.test_sampling import frequencies, sample
from tests.test_scheduler import END, SameLogits, decode_to_the_end

SAMPLED = RowSettings(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, repetition_penalty=1.0)
NUCLEUS = RowSettings(do_sample=True, temperature=0.8, top_k=0, top_p=0.7, repetition_penalty=1.0)
TOP_K = RowSettings(do_sample=True, temperature=1.0, top_k=5, top_p=1.0, repetition_penalty=1.0)


def text(manager, question: str, **settings) -> str:
    messages = [{"role": "user", "content": [{"type": "text", "text": question}]}]
    return reply(manager, messages, manager.default_settings().with_overrides({"do_sample": False, **settings}))


def draws(logits: torch.Tensor, rows: list, seeds: list, steps: int = 12) -> list[list[int]]:
    """Each row's tokens over `steps` draws from the same logits, a row with a seed drawing with its own generator."""
    generators = [None if seed is None else torch.Generator().manual_seed(seed) for seed in seeds]
    end = torch.tensor([0])
    picks = [next_tokens(logits.clone(), rows, [None] * len(rows), [False] * len(rows), end, generators) for _ in range(steps)]
    return torch.stack(picks).T.tolist()


@pytest.mark.parametrize("row", [SAMPLED, NUCLEUS, TOP_K])
def test_a_seeded_row_draws_the_same_whatever_its_neighbours_and_its_place(row):
    torch.manual_seed(0)
    logits = torch.randn(4, 50)
    alone = draws(logits[2:3], [row], [77])[0]
    beside = draws(logits, [row, row, row, SAMPLED], [None, 5, 77, None])
    assert beside[2] == alone  # its draws, in a batch of others
    assert draws(logits[[3, 2]], [SAMPLED, row], [None, 77])[1] == alone  # ...and in another place of it
    assert draws(logits[2:3], [row], [78])[0] != alone
    assert len({tuple(draws(logits[2:3], [row], [None])[0]) for _ in range(3)}) > 1  # without a seed: anew each time


@pytest.mark.parametrize("row", [SAMPLED, NUCLEUS, TOP_K])
def test_a_seeded_rows_draws_follow_its_distribution(row):
    logits = torch.tensor([[2.0, 0.5, 3.0, -1.0, 1.0, 2.5, 0.0, -2.0]])
    expected = sample_frequencies(row, logits)
    count = 20000  # rows of the same logits, each with a seed of its own: one draw each
    seeded = next_tokens(logits.repeat(count, 1), [row] * count, [None] * count, [False] * count, torch.tensor([0]),
                         [torch.Generator().manual_seed(seed) for seed in range(count)])
    assert torch.allclose(frequencies(seeded, 8), expected, atol=0.015)


def sample_frequencies(row: RowSettings, logits: torch.Tensor) -> torch.Tensor:
    """The distribution the row draws from, by the unseeded sampler (tests/test_sampling.py checks it)."""
    torch.manual_seed(5)
    return frequencies(sample(row, logits, 40000), logits.shape[-1])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_on_a_gpu_seeded_draws_never_wait_for_it_and_repeat_in_any_batch():
    torch.manual_seed(3)
    logits = torch.randn(4, 248_000, device="cuda")
    rows, seeds = [SAMPLED, NUCLEUS, TOP_K, SAMPLED], [1, 2, None, 3]
    end = torch.tensor([0], device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        generators = [None if seed is None else torch.Generator(device="cuda").manual_seed(seed) for seed in seeds]
        chosen = next_tokens(logits.clone(), rows, [None] * 4, [False] * 4, end, generators)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    alone = next_tokens(logits[1:2].clone(), [NUCLEUS], [None], [False], end, [torch.Generator(device="cuda").manual_seed(2)])
    assert chosen[1].item() == alone.item()


def test_a_seeded_row_whose_logits_are_not_numbers_fails_alone():
    logits = torch.randn(2, 10)
    logits[1] = float("nan")
    chosen = next_tokens(logits, [SAMPLED, SAMPLED], [None, None], [False, False], torch.tensor([0]),
                         [torch.Generator().manual_seed(1), torch.Generator().manual_seed(2)])
    assert chosen[1] == -1 and 0 <= chosen[0] < 10


@pytest.mark.parametrize("logits, settings, reason", [
    ([0, 0, 0, 5, 0, 0, 0, 0, 0, 0], {"max_new_tokens": 3}, "length"),
    ([0, 0, 0, 0, 3, 0, 0, 0, 0, 5], {"max_new_tokens": 20, "min_new_tokens": 2}, "stop"),
])
def test_the_end_says_why_the_reply_ended(logits, settings, reason):
    scheduler = Scheduler(max_batch=4, max_waiting=0, metrics=EngineMetrics())
    scheduler.runner, scheduler._end_token_set = SameLogits(logits), {END}
    events = []
    request = Request(messages=[], prepared=None, settings=GenerationSettings(do_sample=False, **settings), version=0,
                      requested_at=0.0, emit=lambda kind, value: events.append((kind, value)))
    request.last_token, request.started_at = 0, 0.0
    scheduler._running.append(request)
    decode_to_the_end(scheduler)
    kinds = [kind for kind, _ in events]
    assert kinds[0] == ReplyEvent.FIRST_TOKEN and kinds[1] == ReplyEvent.TOKENS and kinds[-1] == ReplyEvent.END
    assert events[-1][1]["finish_reason"] == reason and kinds.count(ReplyEvent.FIRST_TOKEN) == 1


def test_a_stop_text_ends_the_reply_where_it_starts_and_frees_the_slot(manager):
    full = text(manager, "Count to ten.", max_new_tokens=60, min_new_tokens=60)
    stop = full.text[25:29]
    updates = []
    settings = manager.default_settings().with_overrides({"do_sample": False, "max_new_tokens": 60, "stop": ["\u2603\u2603", stop]})
    for update in manager.stream([{"role": "user", "content": [{"type": "text", "text": "Count to ten."}]}], settings):
        updates.append(update)
    cut = updates[-1]
    assert cut.text == full.text[:full.text.index(stop)] and cut.stats["finish_reason"] == "stop"
    assert cut.stats["new_tokens"] < 60 and cut.stats["ttft_ms"] > 0 and cut.stats["queue_ms"] >= 0
    assert all(cut.text.startswith(update.text) for update in updates)  # no update showed what the stop text took back
    assert wait_for(lambda: manager.active_generations == 0, 5)


def test_a_stop_text_counts_only_once_the_reply_has_its_minimum_length(manager):
    full = text(manager, "Count to ten.", max_new_tokens=40, min_new_tokens=40).text
    early = full[1:4]  # within the first few tokens
    kept = text(manager, "Count to ten.", max_new_tokens=40, min_new_tokens=40, stop=[early])
    assert kept.text.startswith(full[:full.index(early) + len(early)]) and kept.stats["new_tokens"] >= 20


def test_ask_takes_stop_and_seed_as_settings(client, manager):
    full = text(manager, "Hello there", max_new_tokens=30, min_new_tokens=30).text
    _, (answer, stats) = stream(client, "Hello there", [], {"max_new_tokens": 30, "do_sample": False, "stop": full[12:15]})
    assert answer == full[:full.index(full[12:15])] and stats["finish_reason"] == "stop"
    sampled = {"max_new_tokens": 12, "min_new_tokens": 12, "do_sample": True, "temperature": 1.0, "seed": 99}
    assert stream(client, "Hi", [], sampled)[1][0] == stream(client, "Hi", [], sampled)[1][0]


def test_a_system_message_is_kept_when_old_turns_are_left_out(manager, tmp_path):
    settings = manager.default_settings().with_overrides({"max_new_tokens": 8})
    picture = make_image(tmp_path, "small.png", (64, 64))
    turns = [{"role": "system", "content": [{"type": "text", "text": "Answer like a pirate."}]}]
    for index in range(3):  # 3 turns of 8 images: more than a request may hold, so the oldest goes
        turns += [{"role": "user", "content": [{"type": "image", "path": picture}] * 8 + [{"type": "text", "text": f"Q{index}"}]},
                  {"role": "assistant", "content": [{"type": "text", "text": f"A{index}"}]}]
    prepared = manager.prepare(turns[:-1], settings)
    prompt = manager.processor.tokenizer.decode(prepared.tensors["input_ids"][0])
    assert prompt.count("Answer like a pirate.") == 1 and "Q0" not in prompt and "Q1" in prompt
    assert prepared.notices and prepared.notices[0].startswith("The 2 oldest messages were left out")


def test_the_external_engine_is_asked_for_stop_texts_and_seeds():
    engine = OpenAIEngine(AppConfig(backend="openai"))
    payload = engine._payload([], GenerationSettings(stop=("END",), seed=5, do_sample=True))
    assert payload["stop"] == ["END"] and payload["seed"] == 5
    greedy = engine._payload([], GenerationSettings(do_sample=False, seed=5))
    assert "stop" not in greedy and "seed" not in greedy  # a greedy reply draws nothing


def test_a_stop_set_while_preparing_is_no_error(manager):
    """A stop signal set at once still ends the reply quietly (the API sets it when its client goes)."""
    from app.engine.stop_signal import StopSignal

    stop = StopSignal()
    threading.Timer(0.01, stop.set).start()
    settings = manager.default_settings().with_overrides({"max_new_tokens": 2000, "min_new_tokens": 2000, "stop": ["x" * 20]})
    updates = list(manager.stream([{"role": "user", "content": [{"type": "text", "text": "Go."}]}], settings, stop))
    # No error; a last update, if any (once prepared), is marked stopped.
    assert all(update.stats is None for update in updates[:-1])
    assert not updates or updates[-1].stats is None or updates[-1].stopped
    assert wait_for(lambda: manager.active_generations == 0, 5)
