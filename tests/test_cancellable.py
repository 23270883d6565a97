"""A reply's handler as Gradio runs it (app.ui.cancellable): a Clear silences it, and its last update is the
Clear's own, whichever of the two the page applies last (docs/DECISIONS.md D62)."""

import asyncio
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
