"""The exception types whose message is meant for the user, by what went wrong (the OpenAI-compatible API
answers each with its own HTTP status: app.web.openai_api), and what makes a message's text fit to show."""


def displayable(text: str) -> str:
    """`text` with each lone surrogate (which JSON can carry and no UTF-8 message can: Gradio's event stream
    broke off on one, for every event of the session) shown as "?"."""
    return text if text.isascii() else text.encode("utf-8", "replace").decode("utf-8")


class UserError(ValueError):
    """Bad input or an unmet limit: shown to the user as is, and the app keeps serving."""


class Busy(UserError):
    """The wait line is full: the demo is busy (the request is counted as turned away, not as an error)."""


class NotReady(UserError):
    """The model cannot take requests now: it is being switched, its process is restarting, or the external
    server (--backend openai) is down. Trying again later may work."""


class ServingFailed(UserError):
    """The request was sound but serving it failed (out of memory, a generation error, an external server
    that broke off)."""


class ModelUnavailable(UserError):
    """The model cannot be found locally nor fetched: the app cannot start."""
