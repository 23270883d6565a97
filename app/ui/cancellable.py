"""Streaming handlers that a cancel ends at once, whatever they are doing."""

import asyncio
import contextlib
import inspect
import threading

import anyio
import gradio as gr

from app.engine.stop_signal import StopSignal
from app.zerogpu import zero_gpu_enabled

_END = object()


class StopControl:
    """The replies in progress in one chat, by session: its Stop ends them through their own handlers, which
    show what each had said when it came, marked as stopped and with its stats. A cancel (Gradio's) ends a
    handler where it is, with nothing more said: reasoning cut off stayed "thinking" on the page."""

    def __init__(self):
        self._lock = threading.Condition()
        self._running: dict[str, set[StopSignal]] = {}
        # Stopped by a Clear, with what the Clear shows: each one's last update, then nothing more of it (an
        # empty tuple: nothing at all).
        self._silenced: dict[StopSignal, tuple] = {}

    def started(self, session: str | None, stop: StopSignal) -> None:
        if session is not None:
            with self._lock:
                self._running.setdefault(session, set()).add(stop)

    def ended(self, session: str | None, stop: StopSignal) -> None:
        with self._lock:
            self._silenced.pop(stop, None)
            stops = self._running.get(session, set())
            stops.discard(stop)
            if not stops:
                self._running.pop(session, None)
                self._lock.notify_all()

    def stop(self, request: gr.Request) -> None:
        """The Stop event's function: ends the replies of the session that clicked it."""
        with self._lock:
            stops = list(self._running.get(request.session_hash, ()))
        for stop in stops:
            stop.set()

    def silence(self, request: gr.Request, timeout: float, shown: tuple) -> None:
        """Stop the session's replies, each ending with `shown` (what a Clear shows, for its first outputs) and
        nothing more, and wait (up to `timeout` s) until their handlers have ended.

        Not with nothing at all: the page applies a streaming event's updates on timers of its own (Gradio
        6.31), and one sent just before the Clear's was seen to land after it, putting the conversation back
        (docs/DECISIONS.md D62). Ending on what the Clear shows, the reply's last update is the Clear's too."""
        session = request.session_hash
        with self._lock:
            self._silenced.update((stop, shown) for stop in self._running.get(session, ()))
        self.stop(request)
        with self._lock:
            if not self._lock.wait_for(lambda: session not in self._running, timeout):
                # Still running after the wait: its update could come after a newer question's, which it must
                # not empty. It ends showing nothing more.
                self._silenced.update((stop, ()) for stop in self._running.get(session, ()))

    def last_update(self, stop: StopSignal, update):
        """What a silenced reply shows instead of `update`, its next (and last) one; None if it is not silenced."""
        with self._lock:
            shown = self._silenced.get(stop)
        if shown is None:
            return None
        if not isinstance(update, tuple):
            return shown[0] if shown else gr.skip()
        return (*shown[:len(update)], *[gr.skip()] * (len(update) - len(shown)))


def cancellable(handler, blocks, control: StopControl | None = None):
    """`handler` (a generator function that takes `stop=`, a StopSignal) as an async generator for Gradio;
    `control`, if given, can end it through its own handler too (StopControl).

    Gradio runs a plain generator's every step in a thread that a cancel (Stop, gradio_client's
    job.cancel(), a client gone) cannot interrupt, and keeps the generator to close it only once its
    first step is out: a reply cancelled while its request was still being prepared streamed on to
    its last token. An async generator gets the cancel at once, inside the step; its `finally` sets the
    StopSignal, which ends the reply in the engine within a decode step, and the handler's thread with it.
    Each step runs in a thread of `blocks`' pool (Gradio's, sized by launch's max_threads).

    On ZeroGPU, where the handler runs in a GPU worker process of its own, it is left as it is.
    """
    if zero_gpu_enabled():
        return handler
    control = control or StopControl()  # one that nothing stops: only cancels end the handler

    async def run(request: gr.Request, *values):
        stop, session = StopSignal(), request.session_hash
        control.started(session, stop)

        def end(_event=None) -> None:
            control.ended(session, stop)
            stop.set()

        # Gradio keeps a streaming event's generator, to close it when the event is cancelled, only once a step has
        # returned: a cancel landing after the first yield but before that (Gradio 6.31) left it suspended there,
        # its `finally` never run and its reply going on in the engine. The end of the event's task ends it too (D65).
        event = asyncio.current_task()
        if event is not None:
            event.add_done_callback(end)
        updates = handler(*values, stop=stop)
        try:
            while (update := await anyio.to_thread.run_sync(next, updates, _END, abandon_on_cancel=True,
                                                            limiter=blocks.limiter)) is not _END:
                if (last := control.last_update(stop, update)) is not None:
                    yield last
                    break
                yield update
        finally:
            end()
            with contextlib.suppress(ValueError):  # still running in its thread, where the stop ends it
                updates.close()

    run.__name__ = handler.__name__  # an event's default api_name
    run.__signature__ = _as_gradio_reads_it(handler)
    return run


def _as_gradio_reads_it(handler) -> inspect.Signature:
    """run's signature for Gradio: the request it fills in, then `handler`'s own parameters but `stop`, so that
    the API page and gradio_client name the inputs (text, files, ...) rather than param_0, param_1."""
    own = [parameter for parameter in inspect.signature(handler).parameters.values() if parameter.name != "stop"]
    request = inspect.Parameter("request", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=gr.Request)
    return inspect.Signature([request, *own])


def cancel_on_reset_route(blocks):
    """POST /gradio_api/reset: what gradio_client sends to cancel a job whose id it learned only after
    job.cancel() was called (its POST /cancel, sent without an id, was refused). Gradio 6 answers it and
    does nothing, so such a reply ran on to its end; here it cancels that event as Gradio's /cancel does:
    out of the wait line, or its running task cancelled (which ends the reply: cancellable)."""
    from fastapi import Body
    from fastapi.routing import APIRoute
    from gradio.route_utils import API_PREFIX
    from gradio.utils import cancel_tasks

    async def reset(event_id: str = Body(embed=True)) -> dict:
        queue = blocks._queue
        running = (event for job in queue.active_jobs if job for event in job)
        event = queue.event_ids_to_events.get(event_id) or next((e for e in running if e._id == event_id), None)
        if event is not None:
            await queue.remove_from_queue(event_id)
            await cancel_tasks({f"{event.session_hash}_{event.fn._id}"})
        return {"success": True}

    return APIRoute(f"{API_PREFIX}/reset", reset, methods=["POST"])
