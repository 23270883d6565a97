"""A user's mistake as Gradio shows it: the message, one line in the server's log, and no traceback
(Gradio prints a whole traceback for every gr.Error unless told not to; real faults keep theirs)."""

import logging

import gradio as gr

from app.errors import displayable

log = logging.getLogger("app.refused")


def refusal(message: str) -> gr.Error:
    """The gr.Error to raise for `message`, logged as one line; what it quotes from the request (an unknown
    setting's name, say) made displayable."""
    message = displayable(message)
    log_refusal(message)
    return gr.Error(message, print_exception=False)


def log_refusal(message: str) -> None:
    log.info("Refused: %s", message)
