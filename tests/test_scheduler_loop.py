"""The scheduler's whole loop against a stand-in runner whose slots hold the tokens fed to them: through waves
joining behind the step in flight, leaves that move slots, cancellations and inline mode, every request's reply
is its reply alone (docs/DECISIONS.md D50); and the loop's edges: a wave whose first choice fails, a wave whose
media's launch fails on the launcher's thread, pause()."""

import contextlib
import dataclasses
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from app.engine import scheduler as scheduler_module
from app.engine.inputs import PreparedInputs
from app.engine.metrics import EngineMetrics
from app.engine.request import Request
from app.engine.scheduler import Scheduler
from app.engine.settings import GenerationSettings, RowSettings
from app.model.runner import BatchRunner
from app.model.sampling import choose
from app.model.streams import MediaEncoding
from tests.conftest import wait_for

VOCAB, END = 50, 7
BUCKETS = (1, 2, 4, 8, 16, 32)  # a captured step pads its rows to one of these


def next_logits(tokens: list[int]) -> torch.Tensor:
    """Logits that depend on a whole sequence: a favourite token, a runner-up, and now and then the end."""
    h = hash(tuple(tokens)) & 0xFFFFFFFF
    logits = torch.zeros(VOCAB)
    logits[h % VOCAB] = 3.0
    logits[(h // VOCAB) % VOCAB] = 2.0 + ((h >> 8) % 7) / 10
    if h % 5 == 0:
        logits[END] = 4.0
    return logits


class Encoding:
    def __init__(self, count: int, ready):
        self.count, self._ready, self.seconds = count, ready, 0.0

    def ready(self, wait: bool) -> bool:
        return wait or self._ready()

    def features(self):
        return [None] * self.count


class SequenceSlots:
    """A stand-in BatchRunner: slot i holds the tokens fed to it, and its logits depend on all of them. Moves copy
    what a slot holds, up to the columns asked (fewer than it holds is recorded), and a step's padding rows feed
    free slots a dummy token, as a captured step does."""

    device = torch.device("cpu")
    continues = False
    end_token_ids = [END]
    joined = staticmethod(BatchRunner.joined)

    def __init__(self, rng: random.Random):
        self.slots = [[] for _ in range(64)]
        self.rng = rng
        self.short_moves = []

    @contextlib.contextmanager
    def serving(self):
        with torch.inference_mode():
            yield

    def encode_media_ahead(self, batch, decoding):
        return Encoding(len(batch), lambda: self.rng.random() < 0.5)

    def prefill(self, prompts, first_slot, columns):
        for index, (ids, _, _) in enumerate(prompts):
            self.slots[first_slot + index] = ids[0].tolist()
        return torch.stack([next_logits(self.slots[first_slot + index]) for index in range(len(prompts))])

    def decode(self, tokens):
        n = tokens.shape[0]
        for slot in range(n):
            self.slots[slot].append(int(tokens[slot]))
        for slot in range(n, next(size for size in BUCKETS if size >= n)):
            self.slots[slot].append(0)
        return torch.stack([next_logits(self.slots[slot]) for slot in range(n)])

    def choose(self, logits, rows, seen, barred, generators=None):
        return choose(logits, rows, seen, barred, torch.tensor(self.end_token_ids), generators)

    def tokens_on_device(self, tokens):
        return torch.tensor(tokens)

    def rows(self, tensor, index):
        return tensor[index]

    def move(self, sources, targets, columns):
        self.short_moves += [(source, columns) for source in sources if columns < len(self.slots[source])]
        copies = [list(self.slots[source][:columns]) for source in sources]
        for target, copy in zip(targets, copies):
            self.slots[target] = copy

    @staticmethod
    def after_error(error):
        return False


def alone(prompt: list[int], settings: GenerationSettings) -> list[int]:
    """The reply a request gets alone: greedy, with its penalty and minimum length."""
    tokens, generated = list(prompt), []
    seen = torch.tensor(prompt) if settings.repetition_penalty != 1.0 else None
    row = RowSettings(False, settings.temperature, settings.top_k, settings.top_p, settings.repetition_penalty)
    while True:
        choice = choose(next_logits(tokens)[None].clone(), [row], [seen], [len(generated) < settings.min_new_tokens],
                        torch.tensor([END]))
        seen, token = choice.seen[0], int(choice.as_input[0])
        if token == END:
            return generated
        generated.append(token)
        if len(generated) >= settings.max_new_tokens:
            return generated
        tokens.append(token)


def new_request(rng: random.Random, number: int, events: dict, **settings) -> tuple[Request, list[int]]:
    prompt = [(100 + number) % VOCAB] + [rng.randrange(VOCAB) for _ in range(rng.randint(1, 6))]
    most = rng.randint(1, 12)
    settings = {"do_sample": False, "max_new_tokens": most, "min_new_tokens": rng.randint(0, most),
                "repetition_penalty": rng.choice([1.0, 1.0, 1.5]), **settings}
    request = Request(messages=[], prepared=PreparedInputs(tensors={"input_ids": torch.tensor([prompt])},
                                                           prompt_tokens=len(prompt)),
                      settings=GenerationSettings(**settings), version=1, requested_at=0.0,
                      emit=lambda kind, value: events.setdefault(number, []).append((kind, value)))
    return request, prompt


def new_scheduler(runner, max_batch: int = 8, inline: bool = False) -> Scheduler:
    scheduler = Scheduler(max_batch=max_batch, max_waiting=1000, metrics=EngineMetrics(), inline=inline)
    scheduler.runner, scheduler.version, scheduler._end_token_set = runner, 1, {END}
    return scheduler


def check_events(events: list, generated: list[int], cancelled: bool) -> None:
    """One end (or error) and last, or none for a request cancelled before it; the tokens handed out are its own."""
    kinds = [kind for kind, _ in events]
    ends = [index for index, kind in enumerate(kinds) if kind in ("end", "error")]
    assert ends == [len(kinds) - 1] or (cancelled and not ends), kinds
    handed_out = [token for kind, value in events if kind == "tokens" for token in value]
    assert handed_out == generated[:len(handed_out)]


def check_replies(scheduler, runner, requests: list, events: dict) -> None:
    assert not runner.short_moves
    assert scheduler._in_flight is None and not scheduler._joined and not scheduler._running
    for number, request, prompt in requests:
        if request.started_at is None:
            continue
        expected, cancelled = alone(prompt, request.settings), request.cancelled.is_set()
        assert request.generated == (expected[:len(request.generated)] if cancelled else expected), number
        check_events(events.get(number, []), request.generated, cancelled)


@pytest.mark.parametrize("inline", [False, True])
@pytest.mark.parametrize("seed", range(12))
def test_every_reply_is_its_own_through_joins_leaves_and_cancellations(seed, inline):
    rng = random.Random(seed)
    runner = SequenceSlots(rng)
    scheduler = new_scheduler(runner, max_batch=rng.choice([3, 4, 8]), inline=inline)
    events, requests = {}, []
    for _ in range(400):
        if rng.random() < 0.3 and len(requests) < 40:
            for _ in range(rng.randint(1, 4)):
                request, prompt = new_request(rng, len(requests), events)
                requests.append((len(requests), request, prompt))
                scheduler.submit(request)
        live = [request for _, request, _ in requests if not request.done and not request.cancelled.is_set()]
        if live and rng.random() < 0.05:
            rng.choice(live).cancelled.set()
        scheduler._iteration(wait=False)
    while scheduler._iteration(wait=False):
        pass
    check_replies(scheduler, runner, requests, events)


@pytest.mark.parametrize("seed", range(12))
def test_every_reply_is_its_own_when_callers_cancel_as_their_tokens_come(seed):
    rng = random.Random(1000 + seed)
    runner = SequenceSlots(rng)
    scheduler = new_scheduler(runner, max_batch=rng.choice([2, 3, 5]))
    events, requests = {}, []
    for number in range(30):
        request, prompt = new_request(rng, number, events)
        emit = request.emit

        def cancelling_emit(kind, value, request=request, emit=emit):
            emit(kind, value)
            if kind == "tokens" and rng.random() < 0.1:
                request.cancelled.set()
        request.emit = cancelling_emit
        requests.append((number, request, prompt))
    for _ in range(2000):
        unsent = [request for _, request, _ in requests if request.started_at is None and request not in scheduler._waiting]
        if unsent and rng.random() < 0.2:
            scheduler.submit(unsent[0])
        scheduler._iteration(wait=False)
    check_replies(scheduler, runner, requests, events)


class FailingFirstChoice(SequenceSlots):
    """choose() runs out of memory for the first tokens of a wave of two."""

    def choose(self, logits, rows, seen, barred, generators=None):
        if len(rows) == 2 and not hasattr(self, "failed"):
            self.failed = True
            raise torch.cuda.OutOfMemoryError("no room for the wave's choice")
        return super().choose(logits, rows, seen, barred, generators)


def test_a_wave_whose_first_tokens_cannot_be_chosen_hears_the_error():
    rng = random.Random(0)
    scheduler = new_scheduler(FailingFirstChoice(rng))
    events = {}
    for number in range(2):
        scheduler.submit(new_request(rng, number, events, max_new_tokens=50, min_new_tokens=0)[0])
    for _ in range(20):
        scheduler._iteration(wait=False)
    assert all(events[number][-1][0] == "error" for number in range(2)), events


class FailingLaunch(SequenceSlots):
    """Each wave's media launched on a thread of its own, as on CUDA (app.model.streams.SideStreams); the
    second wave's launch runs out of memory there."""

    def __init__(self, rng: random.Random):
        super().__init__(rng)
        self.launcher, self.waves = ThreadPoolExecutor(1), 0

    def encode_media_ahead(self, batch, decoding):
        self.waves += 1

        def launch(wave=self.waves):
            time.sleep(0.02)
            if wave == 2:
                raise torch.cuda.OutOfMemoryError("no room for the wave's tower")
            return [None] * len(batch)
        return MediaEncoding(self.launcher.submit(launch), None, 0.0)


def test_a_wave_whose_media_launch_fails_hears_the_error_and_the_running_reply_goes_on():
    rng = random.Random(5)
    runner = FailingLaunch(rng)
    scheduler = new_scheduler(runner)
    events, requests = {}, []
    for number in range(3):
        request, prompt = new_request(rng, number, events, max_new_tokens=40, min_new_tokens=40)
        requests.append((number, request, prompt))
    scheduler.submit(requests[0][1])
    assert wait_for(lambda: scheduler._iteration(wait=False) and requests[0][1].generated, 5)
    for _, request, _ in requests[1:]:
        scheduler.submit(request)
        assert wait_for(lambda: scheduler._iteration(wait=False) and request.started_at and not scheduler._encoding, 5)
    while scheduler._iteration(wait=False):
        pass
    runner.launcher.shutdown()
    failed = requests[1][1]
    assert [kind for kind, _ in events[1]] == ["error"] and not failed.generated
    assert isinstance(events[1][0][1], torch.cuda.OutOfMemoryError)
    for number, request, prompt in (requests[0], requests[2]):
        assert request.generated == alone(prompt, request.settings), number
        check_events(events[number], request.generated, cancelled=False)


class SlowReadBack(SequenceSlots):
    """A step's tokens come back 0.3 s after its launch, as from a busy GPU; `read_at` is when the last did."""

    def choose(self, logits, rows, seen, barred, generators=None):
        choice = super().choose(logits, rows, seen, barred, generators)
        runner, read_back = self, choice.read_back

        class Slow:
            def tolist(self):
                time.sleep(0.3)
                runner.read_at = time.perf_counter()
                return read_back.tolist()
        return dataclasses.replace(choice, read_back=Slow())


def test_pause_returns_only_once_the_last_step_is_handed_out():
    rng = random.Random(3)
    runner = SlowReadBack(rng)
    scheduler = new_scheduler(runner, max_batch=4)
    scheduler.attach(runner, 1, prepare_again=None, conversations=scheduler.conversations, images=scheduler.images)
    scheduler.submit(new_request(rng, 0, {}, max_new_tokens=3, min_new_tokens=0)[0])
    time.sleep(0.05)
    assert scheduler.pause(10)
    paused_at = time.perf_counter()  # a model switch unloads the runner from here on
    time.sleep(1)
    assert runner.read_at < paused_at


def test_pause_waits_for_a_wave_being_prefilled(monkeypatch):
    prefill_wave, prefilling = scheduler_module.prefill_wave, threading.Event()

    def slow_prefill_wave(*args):
        prefilling.set()
        time.sleep(0.5)
        result = prefill_wave(*args)
        prefilling.clear()
        return result
    monkeypatch.setattr(scheduler_module, "prefill_wave", slow_prefill_wave)
    rng = random.Random(4)
    runner = SequenceSlots(rng)
    scheduler = new_scheduler(runner, max_batch=4)
    scheduler.attach(runner, 1, prepare_again=None, conversations=scheduler.conversations, images=scheduler.images)
    events = {}
    scheduler.submit(new_request(rng, 0, events)[0])
    assert prefilling.wait(5)
    result = []
    pauser = threading.Thread(target=lambda: result.append((scheduler.pause(5), prefilling.is_set())))
    pauser.start()
    time.sleep(0.05)
    scheduler.submit(new_request(rng, 1, events)[0])  # a newcomer wakes pause()'s wait
    pauser.join()
    assert result == [(True, False)]
