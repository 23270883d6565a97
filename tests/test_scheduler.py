"""The scheduler's decode loop with a stand-in model: a step stays in flight while the one before it is
handed out, and what that step chose still counts for the next one's choice."""

import torch

from app.engine.metrics import EngineMetrics
from app.model.sampling import choose
from app.engine.scheduler import Request, Scheduler
from app.engine.settings import GenerationSettings

END = 9


class SameLogits:
    """A stand-in BatchRunner: every decode step gives every row `logits`, and is counted."""

    device = torch.device("cpu")

    def __init__(self, logits: list[float]):
        self.logits = torch.tensor([logits])
        self.steps = 0

    def decode(self, tokens):
        self.steps += 1
        return self.logits.expand(tokens.shape[0], -1).clone()

    def choose(self, logits, rows, seen, barred, generators=None):
        return choose(logits, rows, seen, barred, torch.tensor([END]), generators)

    def tokens_on_device(self, tokens):
        return torch.tensor(tokens)

    def move(self, source: int, target: int) -> None:
        pass


def running(logits: list[float], **settings) -> tuple[Scheduler, Request, list[str]]:
    """A scheduler running one request past its first token, and the kinds of event the request got."""
    scheduler = Scheduler(max_batch=4, max_waiting=0, metrics=EngineMetrics())
    scheduler.runner = SameLogits(logits)
    scheduler._end_token_set = {END}
    events = []
    request = Request(messages=[], prepared=None, settings=GenerationSettings(do_sample=False, **settings), version=0,
                      requested_at=0.0, emit=lambda kind, value: events.append(kind))
    request.last_token = 0
    scheduler._running.append(request)
    return scheduler, request, events


def decode_to_the_end(scheduler: Scheduler) -> None:
    with torch.inference_mode():
        for _ in range(100):
            if not scheduler._running:
                return
            scheduler._decode_step()
    raise AssertionError("the request never ended")


def test_the_next_step_is_launched_before_the_last_one_is_handed_out():
    scheduler, request, events = running([0, 0, 0, 5, 0, 0, 0, 0, 0, 0], max_new_tokens=3)
    with torch.inference_mode():
        scheduler._decode_step()
        assert scheduler.runner.steps == 1 and request.generated == []
        scheduler._decode_step()
        assert scheduler.runner.steps == 2 and request.generated == [3]
    decode_to_the_end(scheduler)
    assert request.generated == [3, 3, 3] and events[-1] == "end" and not scheduler._running
    assert scheduler._in_flight is None and scheduler.metrics.decode_steps == scheduler.runner.steps


def test_a_token_in_flight_counts_towards_the_minimum_length():
    # The end token always wins unless barred: the reply is exactly as long as its minimum.
    for minimum in (0, 1, 2, 5):
        scheduler, request, _ = running([0, 0, 0, 0, 3, 0, 0, 0, 0, 5], max_new_tokens=20, min_new_tokens=minimum)
        decode_to_the_end(scheduler)
        assert request.generated == [4] * minimum


def test_a_token_in_flight_is_already_seen_by_the_repetition_penalty():
    scheduler, request, _ = running([0, 1, 2, 5, 4.5, 4, 3.5, 0, 0, -10], max_new_tokens=6, repetition_penalty=2.0)
    request.seen = torch.tensor([0])  # the prompt
    decode_to_the_end(scheduler)
    # Each token once while an unseen one scores higher than every seen one halved (5 / 2 = 2.5 > 2).
    assert request.generated == [3, 4, 5, 6, 3, 3]
