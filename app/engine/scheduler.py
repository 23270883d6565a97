"""Where requests wait for the GPU and run together: the batching scheduler.

Continuous batching with joins at step boundaries. One scheduler thread loops:

1. admit waiting requests, first come first served, while slots are free: a wave of 1, 2, 4, 8...
   requests holding at most tuning.PREFILL_TOKENS_PER_STEP prompt tokens with padding, so the GPU
   kernels meet few shapes; start encoding the media of the whole wave together (on CUDA on a stream
   of its own, so that the running replies' decode steps can go on meanwhile: see app.model.runner);
2. once a wave's media are encoded, prefill its requests together into their slots
   (app.model.batch_cache) and choose their first tokens, handed out with the next step; once that step
   is launched, admit the next wave;
3. launch one decode step shared by every running request, then hand each its token from the step
   before (and a wave's first tokens), which the host reads while this one runs. The next step's input
   is the last one's output, already on the GPU, so the GPU need not wait for the host's bookkeeping
   between steps (docs/DECISIONS.md D19). Nothing between two launches may wait for the GPU
   (app.model.transfers): a wave is prefilled behind the step in flight, and requests that end leave
   their slots behind it too, the next step's inputs gathered on the GPU into the new slot order (D50).
   A request that ended at the step handed out is in the step running and gets no more tokens from it.
   So a request stopped by its caller is in at most two more steps.

Between steps a request that finished, was stopped, or whose client went away leaves its slot; the
others never notice. Joining at step boundaries rather than in waves means a newcomer waits for at
most one wave's encoding and prefill, not for the longest reply of a wave. One wave is encoded at a
time: the vision tower fills the GPU by itself from a few images on.

Each request talks to its caller through its own `emit(kind, value)`: ("place", requests ahead),
("tokens", [ids]), ("end", timing) or ("error", exception). The caller turns tokens into text on its own
thread, or in another process (app.engine.process).
"""

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable

from app import tuning
from app.messages import MSG_BUSY, MSG_SAMPLING_FAILED
from app.engine.conversations import ConversationCache, prefill_wave
from app.engine.encoded_images import EncodedImages, wave_features
from app.engine.inputs import PreparedInputs
from app.engine.metrics import EngineMetrics
from app.engine.api import ReplyEvent
from app.engine.request import Request, stream_update_interval
from app.engine.waves import wave_size
from app.errors import Busy, ServingFailed

log = logging.getLogger(__name__)


@dataclass(eq=False)
class LaunchedStep:
    """A decode step launched and not yet handed out."""
    requests: list[Request]  # its rows, in slot order
    choice: object  # app.model.sampling.Choice: each row's next token, on the device and on its way back
    launched_at: float


class Scheduler:
    def __init__(self, max_batch: int, max_waiting: int, metrics: EngineMetrics, inline: bool = False):
        self.max_batch = max_batch
        # Inline: no thread of its own; the callers waiting for tokens run the loop (drive()). For
        # ZeroGPU, where the GPU exists only inside the callers' decorated functions.
        self.inline = inline
        self._driving = threading.Lock()
        self.max_waiting = max_waiting
        self.metrics = metrics
        self.runner = None
        self.version = 0
        self.conversations = ConversationCache(0)  # the model's kept conversations, given with it (attach)
        self.images = EncodedImages(0)  # its images' features kept once encoded, likewise
        self._prepare_again: Callable[[Request], PreparedInputs] | None = None
        self._end_token_set: set[int] = set()
        self._changed = threading.Condition()
        self._waiting: deque[Request] = deque()
        self._running: list[Request] = []  # request i holds slot i
        # A wave whose media are being encoded, with its app.model.streams.MediaEncoding.
        self._encoding: tuple[list[Request], object] | None = None
        self._in_flight: LaunchedStep | None = None  # the decode step launched last, not handed out yet
        self._joined: list[tuple[list[Request], object]] = []  # waves since, with their first tokens' Choice
        # Each running request's next input token on the device, in slot order, while any is not handed out.
        self._inputs = None
        self._paused = False
        self._thread: threading.Thread | None = None
        metrics.gauges.update(queue_depth=lambda: self.waiting, batch_size=lambda: self.running,
                              kept_conversations=lambda: len(self.conversations),
                              kept_conversation_bytes=lambda: self.conversations.held_bytes,
                              encoded_images=lambda: len(self.images), encoded_image_bytes=lambda: self.images.held_bytes)

    # Control -------------------------------------------------------------------------------------

    def attach(self, runner, version: int, prepare_again: Callable[[Request], PreparedInputs],
               conversations: ConversationCache, images: EncodedImages) -> None:
        """Serve with `runner` (app.model.runner.BatchRunner, a freshly loaded model) from now on, keeping
        its `conversations` and its encoded `images`; `prepare_again` prepares a request that waited through the
        switch for it."""
        with self._changed:
            self.runner, self.version, self._prepare_again = runner, version, prepare_again
            self.conversations, self.images = conversations, images
            self._end_token_set = set(runner.end_token_ids)
            self._paused = False
            self._changed.notify_all()
        if self._thread is None and not self.inline:
            self._thread = threading.Thread(target=self._serve, name="scheduler", daemon=True)
            self._thread.start()

    def detach(self) -> None:
        """Serve no model until the next attach (the model is being unloaded; the scheduler is paused)."""
        with self._changed:
            self.runner = None

    def pause(self, timeout: float) -> bool:
        """Admit no one new and wait until running requests have finished; if they did not in time,
        serve on as before and return False."""
        with self._changed:
            self._paused = True
            if self._changed.wait_for(lambda: not self._running and self._encoding is None, timeout):
                return True
            self._paused = False
            self._changed.notify_all()
            return False

    def resume(self) -> None:
        with self._changed:
            self._paused = False
            self._changed.notify_all()

    @property
    def waiting(self) -> int:
        return sum(not request.cancelled.is_set() for request in list(self._waiting))

    @property
    def running(self) -> int:
        return len(self._running)

    def submit(self, request: Request) -> None:
        """Put `request` in line; the demo is busy (Busy, at once) when the line is full."""
        with self._changed:
            self.check_room()
            self._waiting.append(request)
            self._changed.notify_all()

    def check_room(self) -> None:
        """Raise Busy when the line is full (also asked before a request is prepared)."""
        free_slots = 0 if self._paused else max(0, self.max_batch - len(self._running))
        waiting = self.waiting
        if waiting >= self.max_waiting + free_slots:
            raise Busy(MSG_BUSY.format(waiting=waiting))

    # The loop ------------------------------------------------------------------------------------

    def _serve(self) -> None:
        while True:
            self._iteration(wait=True)

    def drive(self) -> None:
        """Inline mode: one loop iteration on the calling thread (one caller at a time)."""
        with self._driving:
            worked = self._iteration(wait=False)
        if not worked:  # nothing to run (a model switch holds the line): do not spin
            with self._changed:
                self._changed.wait(0.05)

    def _iteration(self, wait: bool) -> bool:
        """Admit a wave and start encoding its media, prefill the wave whose media are ready, decode once;
        False if there was nothing to do. The GPU's work goes through the runner alone."""
        admitted = self._next_admissions(wait) if self._encoding is None else []
        if not admitted and self._encoding is None and not self._running:
            return False
        try:
            with self.runner.serving():
                self._encode(admitted)
                # With nothing running there is nothing to do meanwhile: wait for the media.
                media_ready = self._encoding is not None and self._encoding[1].ready(wait=not self._running)
                if media_ready:
                    self._prefill()
                if any(request.cancelled.is_set() for request in self._running):
                    self._settle()
                    self._leave(lambda request: request.cancelled.is_set())
                if self._running:
                    self._decode_step()
                if media_ready:  # the next wave's media, once this wave's first tokens are out
                    self._encode(self._next_admissions(wait=False))
                if self.inline:  # on ZeroGPU the GPU is the caller's only during its call: nothing stays in flight
                    self._settle()
        except Exception as error:  # a failure of the shared step: every running request gets it
            log.error("Batch step failed", exc_info=error)
            encoding, self._encoding, self._in_flight, self._joined, self._inputs = self._encoding, None, None, [], None
            self._fail(self._running + (encoding[0] if encoding else []), error)
            self._leave(lambda request: True)
        return True

    def _can_admit(self) -> bool:
        return bool(self._waiting) and not self._paused and len(self._running) < self.max_batch

    def _next_admissions(self, wait: bool) -> list[Request]:
        """The next wave (app.engine.waves.wave_size), taken from the front of the line; the cancelled leave
        the line, and those still waiting hear their new places."""
        with self._changed:
            if wait:
                self._changed.wait_for(lambda: self._running or self._can_admit())
            if any(request.cancelled.is_set() for request in self._waiting):
                self._waiting = deque(request for request in self._waiting if not request.cancelled.is_set())
            count = 0
            if self._can_admit():
                count = wave_size((request.prepared.prompt_tokens for request in self._waiting),
                                  self.max_batch - len(self._running), tuning.PREFILL_TOKENS_PER_STEP)
            admitted = [self._waiting.popleft() for _ in range(count)]
            for place, request in enumerate(self._waiting):
                if request.place != place:
                    request.place = place
                    request.emit(ReplyEvent.PLACE, place)
            return admitted

    def _encode(self, admitted: list[Request]) -> None:
        """Start encoding the media of a wave of newcomers (self._encoding)."""
        now = time.perf_counter()
        for request in admitted:
            request.started_at = now
            if request.version != self.version:
                try:
                    request.prepared = self._prepare_again(request)
                    request.version = self.version
                except Exception as error:
                    request.emit(ReplyEvent.ERROR, error)
        admitted = [request for request in admitted if request.version == self.version]
        if not admitted:
            return
        try:
            encoding = self.runner.encode_media_ahead([(r.prepared.tensors, r.settings.downsample_mode) for r in admitted],
                                                      decoding=bool(self._running))
        except Exception as error:
            self._fail(admitted, error)
            return
        for request in admitted:
            request.prepared.drop_pixels()
        self._encoding = (admitted, encoding)
        self.metrics.prefill_work(time.perf_counter() - now)

    def _prefill(self) -> None:
        """Prefill the wave whose media are encoded into the slots after the running requests' (behind the
        decode step in flight), and choose each its first token, handed out with that step."""
        started = time.perf_counter()
        admitted, encoding = self._encoding
        try:
            columns = max(r.prepared.prompt_tokens + r.settings.max_new_tokens for r in admitted)
            features = wave_features(admitted, encoding.features(), self.images, self.runner)
            self.metrics.wave_encoded(encoding.seconds)
            admitted, logits = prefill_wave(self.runner, self.conversations, admitted, features, len(self._running), columns)
        except Exception as error:
            with self._changed:
                self._encoding = None
                self._changed.notify_all()  # pause() waits for no wave
            self._fail(admitted, error)
            return
        running = self._running_inputs()
        # Running before the wave's encoding is let go, so that pause() always sees one or the other (and a
        # failure from here on reaches the wave with the running requests).
        self._running.extend(admitted)
        self._encoding = None
        for request in admitted:
            if request.settings.repetition_penalty != 1.0:  # a pinned copy: a plain one would wait for the GPU
                request.seen = self.runner.tokens_on_device(request.prepared.tensors["input_ids"][0].tolist())
            if request.settings.seed is not None and request.settings.do_sample:
                request.generator = self.runner.generator(request.settings.seed)
        choice = self._choose(admitted, logits, ahead=[0] * len(admitted))
        self._inputs = choice.as_input if running is None else self.runner.joined([running, choice.as_input])
        self._joined.append((admitted, choice))
        self.metrics.tokens(len(admitted))
        self.metrics.prefill_work(time.perf_counter() - started)

    def _running_inputs(self):
        """The running requests' next input tokens on the device, in slot order (None if none runs)."""
        if self._inputs is None and self._running:
            return self.runner.tokens_on_device([request.last_token for request in self._running])
        return self._inputs

    def _decode_step(self) -> None:
        """Launch a decode step for every running request, then hand out the step before it and the waves'
        first tokens (see the module's docstring); the step launched stays in flight, and those that
        ended leave behind it."""
        started = time.perf_counter()
        previous, joined = self._handed_over()
        pending = {id(request) for request in previous.requests} if previous else set()  # a token not handed out
        for requests, _ in joined:
            pending.update(id(request) for request in requests)
        tokens = self._running_inputs()
        choice = self._choose(self._running, self.runner.decode(tokens),
                              ahead=[int(id(request) in pending) for request in self._running])
        self._in_flight, self._inputs = LaunchedStep(list(self._running), choice, started), choice.as_input
        self._hand_out_pending(previous, joined)
        if self._running and all(request.done for request in self._running):
            self._settle()  # the last ones leave once their step is handed out: pause() then means nothing runs
        else:
            self._leave_if_done()
        self.metrics.decode_work(time.perf_counter() - started)

    def _handed_over(self) -> tuple[LaunchedStep | None, list]:
        """The step in flight and the waves' first tokens, no longer pending here."""
        previous, joined = self._in_flight, self._joined
        self._in_flight, self._joined = None, []
        return previous, joined

    def _hand_out_pending(self, step: LaunchedStep | None, joined: list) -> None:
        if step is not None:
            self._hand_out_step(step)
        for requests, choice in joined:
            self._hand_out(requests, choice.read_back.tolist())

    def _settle(self) -> None:
        """Hand out the step in flight and the waves' first tokens, and free the slots of the requests that ended."""
        self._hand_out_pending(*self._handed_over())
        self._inputs = None
        self._leave_if_done()

    def _choose(self, requests: list[Request], logits, ahead: list[int]):
        """Each request's next token from its row of `logits` (an app.model.sampling.Choice); `ahead[i]`:
        tokens chosen for requests[i] and not handed out yet (they count towards its minimum length)."""
        barred = [len(r.generated) + a < r.settings.min_new_tokens for r, a in zip(requests, ahead)]
        choice = self.runner.choose(logits, [r.row for r in requests], [r.seen for r in requests], barred,
                                    [r.generator for r in requests])
        for request, seen in zip(requests, choice.seen):
            request.seen = seen
        return choice

    def _hand_out_step(self, step: LaunchedStep) -> None:
        tokens = step.choice.read_back.tolist()
        self.metrics.decode_step(time.perf_counter() - step.launched_at, sum(not r.done for r in step.requests))
        self._hand_out(step.requests, tokens)

    def _hand_out(self, requests: list[Request], tokens: list[int]) -> None:
        """Hand each request that has not ended its token."""
        now = time.perf_counter()
        # The clock and the update interval once a step, not once a request: this loop runs for every
        # running request at every step, on the thread that launches the GPU's work (benchmarks/experiments/scheduler_step.py,
        # 200 requests, a dev core: 0.8 ms, 1.1-1.5 before).
        interval = stream_update_interval(len(self._running))
        for request, token in zip(requests, tokens):
            if not request.done:
                self._take(request, token, now, interval)

    def _take(self, request: Request, token: int, now: float, interval: float) -> None:
        """Record `token` for its request, which is done if it ends here (it leaves after the step)."""
        if token < 0:  # it could not be sampled (app.model.sampling): it fails alone, the others go on
            request.done = True
            request.emit(ReplyEvent.ERROR, ServingFailed(MSG_SAMPLING_FAILED))
            return
        ended = token in self._end_token_set
        if not ended:
            if request.first_token_at is None:
                request.first_token_at = now
                self.metrics.first_token(now - request.requested_at)
            request.generated.append(token)
            ended = len(request.generated) >= request.settings.max_new_tokens
            if ended:
                request.finish_reason = "length"
        request.last_token, request.done = token, ended
        request.deliver(ended, now, interval)

    def forget_kept(self) -> None:
        """Let go of every kept conversation and encoded image (a warm-up's, an unloaded model's, or on an
        out-of-memory)."""
        self.conversations.clear()
        self.images.clear()

    def _leave_if_done(self) -> None:
        if any(request.done for request in self._running):
            self._leave(lambda request: request.done)

    def _fail(self, requests: list[Request], error: Exception) -> None:
        """Give `error` to each of `requests`, after releasing what an out-of-memory left cached, kept
        conversations included."""
        if self.runner.after_error(error):
            self.forget_kept()
        for request in requests:
            request.emit(ReplyEvent.ERROR, error)

    def _leave(self, leaves: Callable[[Request], bool]) -> None:
        """Free the slots of requests for which `leaves` is true; those past the last staying slot move down,
        in one move, behind the step in flight, and their next inputs with them."""
        with self._changed:
            leaving = [leaves(request) for request in self._running]
            staying = leaving.count(False)
            holes = [slot for slot in range(staying) if leaving[slot]]
            movers = [slot for slot in range(staying, len(leaving)) if not leaving[slot]]
            if self._inputs is not None:
                moved = dict(zip(holes, movers))
                self._inputs = self.runner.rows(self._inputs, [moved.get(slot, slot) for slot in range(staying)]) \
                    if movers else self._inputs[:staying]
            if movers:
                self.runner.move(movers, holes, max(self._running[slot].tokens_held for slot in movers))
                for hole, mover in zip(holes, movers):
                    self._running[hole] = self._running[mover]
            del self._running[staying:]
            self._changed.notify_all()

