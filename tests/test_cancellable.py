"""A reply's handler as Gradio runs it (app.ui.cancellable): a Clear silences it, and its last update is the
Clear's own, whichever of the two the page applies last (docs/DECISIONS.md D62)."""

import asyncio
import contextlib
import threading
import time
from types import SimpleNamespace

import anyio
import gradio as gr

from app.ui.cancellable import StopControl, cancellable

SHOWN = ([], {"submit_btn": True, "__type__": "update"})  # what a Clear puts on the page: an empty chat, Send back


def endless_reply(history, settings, slow_to_stop: float, stop=None):
    """A reply that streams until stopped, then says so, as app.ui.handlers.respond does (after `slow_to_stop` s)."""
    words = []
    while not stop.is_set:
        words.append("word")
        yield [*history, {"role": "assistant", "content": " ".join(words)}], gr.skip(), gr.skip()
        time.sleep(0.01)
    time.sleep(slow_to_stop)
    yield [*history, {"role": "assistant", "content": " ".join(words) + " (stopped)"}], gr.skip(), gr.skip()


async def collect(run, request, silence_after: int, control: StopControl, shown: tuple, wait: float = 5,
                  slow_to_stop: float = 0.0) -> list:
    updates, silenced = [], threading.Thread(target=control.silence, args=(request, wait, shown))
    async for update in run(request, [{"role": "user", "content": "Go on"}], {}, slow_to_stop):
        updates.append(update)
        if len(updates) == silence_after:
            silenced.start()  # the Clear's function runs on a thread of its own, as Gradio runs it
    await anyio.to_thread.run_sync(silenced.join)
    return updates


def test_a_silenced_reply_ends_on_what_the_clear_shows_and_says_nothing_more():
    control, blocks = StopControl(), SimpleNamespace(limiter=None)
    request = SimpleNamespace(session_hash="session-1")
    run = cancellable(endless_reply, blocks, control)
    updates = asyncio.run(collect(run, request, silence_after=3, control=control, shown=SHOWN))
    *streamed, last = updates
    assert len(streamed) >= 3 and all(update[0][-1]["content"].startswith("word") for update in streamed)
    assert last == ([], SHOWN[1], gr.skip())  # the stopped text never reaches the page
    assert not control._running  # the handler ended; the Clear's wait returned with it


def test_a_reply_still_running_after_the_clears_wait_ends_showing_nothing_more():
    """It could come after a newer question's updates, which the Clear's empty chat would wipe."""
    control, blocks = StopControl(), SimpleNamespace(limiter=None)
    request = SimpleNamespace(session_hash="session-2")
    run = cancellable(endless_reply, blocks, control)
    updates = asyncio.run(collect(run, request, silence_after=2, control=control, shown=SHOWN, wait=0.05,
                                  slow_to_stop=0.5))
    assert updates[-1] == (gr.skip(), gr.skip(), gr.skip())
    assert all(update[0] for update in updates[:-1])


def test_a_reply_whose_event_is_cancelled_between_two_steps_is_stopped():
    """Gradio keeps a streaming event's generator, to close it on a cancel, only once a step has returned: cancelled
    just after the first yield, the generator stayed suspended, and its reply went on in the engine. The end of the
    event's task stops it, and its session no longer counts it as running."""
    control, blocks = StopControl(), SimpleNamespace(limiter=None)
    request = SimpleNamespace(session_hash="session-3")
    stops, kept = [], []

    def reply(history, settings, slow_to_stop, stop=None):
        stops.append(stop)
        yield from endless_reply(history, settings, slow_to_stop, stop)

    run = cancellable(reply, blocks, control)

    async def event():
        updates = run(request, [{"role": "user", "content": "Go on"}], {}, 0.0)
        kept.append(updates)  # as Gradio's cancelled step held it: never closed, never collected
        await anext(updates)
        await asyncio.sleep(30)  # the step's own work, after the yield, where the cancel lands

    async def cancelled_after_the_first_yield():
        task = asyncio.create_task(event())
        while not stops:  # the handler has started, and with it the reply's entry in its session
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.1)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        return stops[0].is_set, "session-3" in control._running

    assert asyncio.run(cancelled_after_the_first_yield()) == (True, False)
