"""The scheduler's decode loop with a stand-in model: a step stays in flight while the one before it is
handed out, and what that step chose still counts for the next one's choice."""

import pytest
import torch

from app.engine.inputs import PreparedInputs
from app.engine.metrics import EngineMetrics
from app.model.runner import BatchRunner
from app.model.sampling import choose
from app.engine.request import Request
from app.engine.scheduler import Scheduler
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

    def move(self, sources: list[int], targets: list[int], columns: int) -> None:
        pass

    joined = staticmethod(BatchRunner.joined)

    def rows(self, tensor, index):
        return tensor[index]


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


class SlotContents(SameLogits):
    """A stand-in whose slots hold the request that was put in each: moves copy what a slot holds."""

    def __init__(self, requests: list[Request]):
        super().__init__([0])
        self.slots = list(requests)
        self.moves = []

    def move(self, sources: list[int], targets: list[int], columns: int) -> None:
        self.moves.append((sources, targets, columns))
        for source, target in zip(sources, targets):
            self.slots[target] = self.slots[source]


def test_requests_that_leave_free_their_slots_in_one_move_and_the_rest_stay_dense():
    scheduler = Scheduler(max_batch=8, max_waiting=0, metrics=EngineMetrics())
    requests = [Request(messages=[], prepared=PreparedInputs(tensors={}, prompt_tokens=10 * (i + 1)),
                        settings=GenerationSettings(), version=0, requested_at=0.0, emit=lambda kind, value: None)
                for i in range(7)]
    for request, generated in zip(requests, (3, 1, 4, 1, 5, 9, 2)):
        request.generated = [7] * generated
    scheduler.runner = SlotContents(requests)
    scheduler._running = list(requests)
    leaving = {requests[i] for i in (1, 2, 5)}
    scheduler._leave(lambda request: request in leaving)
    staying = [request for request in requests if request not in leaving]
    assert sorted(scheduler._running, key=requests.index) == staying
    assert scheduler.runner.slots[:len(staying)] == scheduler._running  # each request holds its own slot
    # The two past the last staying slot move, in one call, with room for the longer of them (70 + 2 tokens).
    assert scheduler.runner.moves == [([4, 6], [1, 2], 72)]
    last = scheduler._running[-1]
    scheduler._leave(lambda request: request is last)  # the last slot: nothing moves
    assert len(scheduler.runner.moves) == 1 and last not in scheduler._running


class NextNumber(SlotContents):
    """A stand-in whose every row's next token is its input plus one (an end token at 63)."""

    def __init__(self, requests: list[Request]):
        super().__init__(requests)
        self.logits = torch.zeros((1, 64))

    def decode(self, tokens):
        self.steps += 1
        return torch.nn.functional.one_hot((tokens + 1) % 64, 64).float()


def test_requests_leave_behind_the_step_in_flight_and_the_others_go_on_from_their_own_tokens():
    scheduler = Scheduler(max_batch=8, max_waiting=0, metrics=EngineMetrics())
    lengths = (2, 5, 3, 7, 1, 4)
    requests = [Request(messages=[], prepared=PreparedInputs(tensors={}, prompt_tokens=5), version=0,
                        settings=GenerationSettings(do_sample=False, max_new_tokens=length), requested_at=0.0,
                        emit=lambda kind, value: None) for length in lengths]
    for number, request in enumerate(requests):
        request.last_token = 10 * number
    scheduler.runner = NextNumber(requests)
    scheduler._running = list(requests)
    scheduler._end_token_set = {63}
    settled = []
    scheduler._settle = lambda original=scheduler._settle: (settled.append(len(scheduler._running)), original())
    decode_to_the_end(scheduler)
    for number, (request, length) in enumerate(zip(requests, lengths)):
        assert request.generated == list(range(10 * number + 1, 10 * number + 1 + length))
    # Only the last to leave waited for the step in flight; the others left behind it, moving slots.
    assert settled == [1] and scheduler.runner.moves
    assert scheduler.runner.steps == max(lengths) + 1 and scheduler._in_flight is None


def filled_store():
    """A slot store of 8 slots holding random states: an attention layer (3) and a DeltaNet layer (0)."""
    from app.model.batch_cache import SlotStore

    store = SlotStore(torch.device("cpu"))
    store.reserve(8, 16)  # capacities grow by doubling: 8 slots
    generator = torch.Generator().manual_seed(0)
    store.keys[3] = torch.randn((8, 2, 16, 4), generator=generator)
    store.values[3] = torch.randn((8, 2, 16, 4), generator=generator)
    store.recurrent[0] = torch.randn((8, 2, 4, 4), generator=generator)
    store.conv[0] = torch.randn((8, 8, 4), generator=generator)
    store.lengths[:] = torch.tensor([5, 6, 7, 8, 9, 10, 0, 0])
    return store


def test_slot_moves_copy_every_layers_state_at_once():
    store = filled_store()
    before = {name: tensor.clone() for name, tensor in
              (("keys", store.keys[3]), ("values", store.values[3]), ("recurrent", store.recurrent[0]), ("conv", store.conv[0]))}
    store.move([4, 5], [0, 2], columns=10)
    assert store.lengths.tolist() == [9, 6, 10, 8, 9, 10, 0, 0]
    for name, tensor in (("keys", store.keys[3]), ("values", store.values[3])):
        assert torch.equal(tensor[[0, 2], :, :10], before[name][[4, 5], :, :10]), name
        assert torch.equal(tensor[[1, 3, 4, 5]], before[name][[1, 3, 4, 5]]), name
    for name, tensor in (("recurrent", store.recurrent[0]), ("conv", store.conv[0])):
        assert torch.equal(tensor[[0, 2]], before[name][[4, 5]]) and torch.equal(tensor[1], before[name][1]), name


@pytest.mark.parametrize("joined_bytes", [0, 10**6])  # each snapshot's keys and values alone, or joined
def test_kept_states_come_back_whole_into_other_slots(monkeypatch, joined_bytes):
    from app.model import batch_cache

    monkeypatch.setattr(batch_cache, "SNAPSHOT_SLOTS", 2)  # three slots kept, and restored, in two goes
    monkeypatch.setattr(batch_cache, "RESTORE_JOINED_BYTES", joined_bytes)
    store = filled_store()
    store.rope_deltas[:] = torch.arange(8)
    kept = store.snapshots([1, 4, 2], [6, 9, 3])
    assert [snapshot.columns for snapshot in kept] == [6, 9, 3]
    before = {name: tensor.clone() for name, tensor in (("keys", store.keys[3]), ("values", store.values[3]),
                                                        ("recurrent", store.recurrent[0]), ("conv", store.conv[0]))}
    for tensor in (store.keys[3], store.values[3], store.recurrent[0], store.conv[0]):
        tensor.normal_()  # what the slots held since
    store.restore(kept, [7, 0, 5])
    assert store.lengths[[7, 0, 5]].tolist() == [6, 9, 3] and store.rope_deltas[[7, 0, 5]].tolist() == [1, 4, 2]
    for source, target, length in ((1, 7, 6), (4, 0, 9), (2, 5, 3)):
        assert torch.equal(store.keys[3][target, :, :length], before["keys"][source, :, :length])
        assert torch.equal(store.values[3][target, :, :length], before["values"][source, :, :length])
        assert torch.equal(store.recurrent[0][target], before["recurrent"][source])
        assert torch.equal(store.conv[0][target], before["conv"][source])
    assert kept[0].nbytes == kept[0].states.numel() + 2 * 2 * 6 * 4 * 4  # keys and values of 6 columns, fp32
    empty = store.snapshots([3, 6, 1], [0, 0, 2])  # a first go of no token at all
    store.restore(empty, [2, 4, 5])
    assert store.lengths[[2, 4, 5]].tolist() == [0, 0, 2] and torch.equal(store.recurrent[0][2], store.recurrent[0][3])


def test_the_warm_up_reserves_more_columns_only_where_the_decode_step_reads_its_own(monkeypatch):
    from types import SimpleNamespace

    from app.model.backends import FusedText
    from app.model.runner import BatchRunner
    from app.model.text.layers import TransformersText

    assert not FusedText.reads_every_column and TransformersText.reads_every_column
    gigabyte = 10**9
    card = SimpleNamespace(total_memory=80 * gigabyte)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: card)
    for name, value in (("RESERVED_COLUMNS", 1024), ("RESERVED_COLUMNS_SHARE", 0.16), ("RESERVED_COLUMNS_MAX", 4096)):
        monkeypatch.setattr(f"app.tuning.{name}", value)

    def runner(rows_store, reads_every_column=False, device="cuda"):
        """The parts of a BatchRunner its warm-up's reservation uses: a real slot store (on the CPU, the
        runner's device named apart), the GPU's work stubbed."""
        made = SimpleNamespace(text=SimpleNamespace(reads_every_column=reads_every_column, capture=lambda rows: None),
                               device=torch.device(device), store=rows_store, continues=False,
                               steps=SimpleNamespace(capture_all=lambda rows: None), prefill=lambda *args: None)
        made._reserved_columns = lambda rows: BatchRunner._reserved_columns(made, rows)
        return made

    store = filled_store()  # one attention layer: 2 heads of 4 fp32 keys and values, 64 bytes a column
    assert store.column_bytes() == 64
    rows = 12.8 * gigabyte // (64 * 4096)  # a batch whose 4,096 columns take 12.8 GB: within 16% of 80 GB
    assert BatchRunner._reserved_columns(runner(store), rows) == 4096
    assert BatchRunner._reserved_columns(runner(store), 8) == 4096  # a small batch: no further than the most
    card.total_memory = 48 * gigabyte
    assert BatchRunner._reserved_columns(runner(store), rows) == 2048
    card.total_memory = 24 * gigabyte
    assert BatchRunner._reserved_columns(runner(store), rows) == 1024
    assert BatchRunner._reserved_columns(runner(store, reads_every_column=True), 8) == 1024
    assert BatchRunner._reserved_columns(runner(store, device="cpu"), 8) == 1024
    assert BatchRunner._reserved_columns(runner(type(store)(torch.device("cpu"))), 8) == 1024  # no attention layer yet

    card.total_memory = 80 * gigabyte
    BatchRunner._reserve_batch(runner(store), 8)  # the warm-up's last step: the whole batch's slots taken
    assert (store.slot_capacity, store.column_capacity) == (8, 4096) and store.keys[3].shape[2] == 4096

    from app.model.continued_graphs import CONTINUED_GRAPH_LENGTHS, ContinuedPrefillGraphs
    from app.model.cuda_graphs import graph_length

    went_on = []
    fused_one = runner(store)
    fused_one.continues = True
    fused_one.prefill_continued = lambda prompts, starts, slots, columns: went_on.append((prompts, starts, columns))
    BatchRunner._reserve_batch(fused_one, 8)
    (prompts, starts, columns), = went_on  # the packed continued prefill's kernels built: a wave no graph holds
    lengths = [ids.shape[1] for ids, _ in prompts]
    assert ContinuedPrefillGraphs(store, fused=None)._bucket(lengths, starts, None) is None
    assert graph_length(CONTINUED_GRAPH_LENGTHS, lengths) is None  # nor cut in halves: no 8 prompts are that long
    assert len(prompts) == 8 and max(starts) + max(lengths) <= 1024 <= columns  # within the least a store reserves
