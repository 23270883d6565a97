"""A question's events: the question put into the chat, the reply streamed into it, and Stop. Every failure
is the reply to its turn, in the chat; the box shows Stop while a reply streams and Send otherwise."""

from types import SimpleNamespace

import gradio as gr

from app.chat import ERROR_TITLE, ends_in_error
from app.ui.cancellable import StopControl, cancellable
from app.ui.handlers import Handlers, settings_dict
from app.zerogpu import on_zero_gpu, zero_gpu_enabled

MODEL_EVENTS = "model"  # one concurrency group: every event that generates waits for the same model

_KEEP = object()


def box_answering(value=_KEEP, placeholder: str | None = None):
    """The question box while a reply streams: Stop in place of Send; `value` (the box cleared), and its
    own `placeholder` back, if given."""
    update = gr.update(submit_btn=False, stop_btn=True)
    if placeholder is not None:
        update["placeholder"] = placeholder
    return update if value is _KEEP else {**update, "value": value}


def box_idle(value=_KEEP):
    """The question box once the reply has ended: Send in place of Stop; `value`, if given, put back."""
    update = gr.update(submit_btn=True, stop_btn=False)
    return update if value is _KEEP else {**update, "value": value}


def question_then_answer(add, inputs: int, respond, cleared: int, placeholder: str):
    """One event's function for a question: `add` takes the first `inputs` values and puts the question
    into the history (it returns the history, then new values for the first `cleared` inputs, the box
    first); `respond` streams the reply from the history and the remaining values (the settings). Chained
    as two events, the reply's first text reached the page about 90 ms later (Gradio 6.31 in Chromium, a
    minimal app: 200-235 ms after Enter against 110-146).

    Every failure is the reply to its turn, in the chat (app.chat.error_message), and the box gets back
    what was sent. A refused file ends it there; a reply that fails (an image broken past its header, a
    busy demo) ends it after the model. An empty question is no turn: the box says so, as its placeholder
    (`placeholder` is its own, put back with the next question)."""

    def added_then_answered(*values, stop=None):
        try:
            added = add(*values[:inputs])
        except gr.Error as refused:  # app.ui.refusals: already logged
            yield gr.skip(), _told(values[0], ERROR_TITLE + refused.message), *[gr.skip()] * (cleared - 1)
            return
        history = added[0]
        if ends_in_error(history):  # the box gets back what was sent, as `add` hands it back
            yield added
            return
        yield history, box_answering(added[1], placeholder), *added[2:]
        for history in respond(history, settings_dict(values[inputs:]), stop=stop):
            yield history, *[gr.skip()] * cleared
        if ends_in_error(history):
            yield gr.skip(), box_idle(values[0]), *values[1:cleared]
        else:
            yield gr.skip(), box_idle(), *[gr.skip()] * (cleared - 1)

    return added_then_answered


def _told(message, refusal: str):
    """The box saying `refusal` as its placeholder; a message of spaces alone is emptied, else the placeholder
    would not show and nothing would tell the user."""
    update = gr.update(placeholder=refusal)
    if isinstance(message, str) and not message.strip():  # a plain box (Multi-image, Video)
        update["value"] = ""
    elif isinstance(message, dict) and not (message.get("text") or "").strip() and not message.get("files"):
        update["value"] = {"text": "", "files": []}
    return update


def streaming(handler, blocks, control: StopControl | None = None):
    """A streaming handler as events of `blocks` run it: on ZeroGPU's GPU, and ended at once by a cancel,
    or by `control` through itself (app.ui.cancellable)."""
    return cancellable(on_zero_gpu(handler), blocks, control)


def wire_question(wiring: SimpleNamespace, box, add, add_inputs: list, outputs: list, control: StopControl):
    """A question submitted from `box` as one event (question_then_answer): `outputs` are the chatbot, then
    the first of `add_inputs` that `add` clears (the box first); `control` stops it. The event, for the Stop."""
    added_then_answered = question_then_answer(add, len(add_inputs), wiring.handlers.respond,
                                               cleared=len(outputs) - 1, placeholder=box.placeholder)
    return box.submit(streaming(added_then_answered, wiring.blocks, control), [*add_inputs, *wiring.settings],
                      outputs, concurrency_id=MODEL_EVENTS, concurrency_limit=wiring.concurrency,
                      api_visibility="undocumented")


def wire_answer(wiring: SimpleNamespace, trigger, chatbot, box, control: StopControl):
    """Stream a reply after `trigger` succeeds, Stop in `box` meanwhile. The event, for the Stop."""
    respond = wiring.handlers.respond

    def answer_history(history, *values, stop=None):
        replies = respond(history, settings_dict(values), stop=stop)
        yield next(replies), box_answering()
        for history in replies:
            yield history, gr.skip()
        yield gr.skip(), box_idle()

    return trigger.success(streaming(answer_history, wiring.blocks, control), [chatbot, *wiring.settings],
                           [chatbot, box], concurrency_id=MODEL_EVENTS, concurrency_limit=wiring.concurrency,
                           api_visibility="undocumented")


# How long Clear waits for the reply it stops to end (within a decode step, as Stop does).
CLEAR_WAIT_S = 5.0


def wire_clear(box, chatbot, control: StopControl, answers: list, also: tuple = ()) -> None:
    """The chat's Clear (its bin icon) stops the reply in progress, if any, whose last update is the Clear's
    own (StopControl.silence), then empties the chat. Only emptied by the page, it got the whole conversation
    back with the reply's next update. On ZeroGPU, whose GPU worker runs the handler, it cancels the reply
    instead. `also`: other events that start a new conversation (their listeners, as `gallery.upload`), which
    do the same."""
    def clear(request: gr.Request):
        shown = ([], box_idle())
        control.silence(request, CLEAR_WAIT_S, shown)
        return shown

    for listener in (chatbot.clear, *also):
        listener(clear, None, [chatbot, box], cancels=answers if zero_gpu_enabled() else None,
                 concurrency_limit=None, api_visibility="undocumented")


def wire_stop(box, chatbot, control: StopControl, answers: list) -> None:
    """The box's Stop ends its chat's reply through the reply's own handler (StopControl). On ZeroGPU, whose
    GPU worker runs the handler, it cancels the event instead, and marks reasoning it cut off as done."""
    if zero_gpu_enabled():
        box.stop(lambda history: (Handlers.end_stopped_reply(history), box_idle()), [chatbot], [chatbot, box],
                 cancels=answers, concurrency_limit=None, api_visibility="private")
    else:
        box.stop(control.stop, None, None, queue=False, api_visibility="private")


# A reply's stats, opened, draw their table below the chat's fold (under the last reply, always): the chat scrolls
# it into view as it opens (Gradio draws it over a few hundred ms), where a newcomer at either width found it cut off.
OPENED_STATS_INTO_VIEW = """() => {
    if (document.body.dataset.statsIntoView) return;
    document.body.dataset.statsIntoView = "1";
    const toggled = (event) => {
        const title = event.target.closest && event.target.closest(".thought-group > .title");
        const group = title && title.parentElement;
        if (!group || !group.querySelector(".reply-stats")) return;
        if (event.type === "keydown" && event.key !== "Enter" && event.key !== " ") return;
        const until = performance.now() + 800;  // the chat's scrolling height catches up a few frames late
        const follow = () => {
            group.scrollIntoView({block: "nearest"});
            if (performance.now() < until) requestAnimationFrame(follow);
        };
        requestAnimationFrame(follow);
    };
    document.addEventListener("click", toggled, true);  // caught on the way down: the title stops its clicks there
    document.addEventListener("keydown", toggled, true);
}"""
