"""The exception types whose message is meant for the user, by what went wrong (the OpenAI-compatible API
answers each with its own HTTP status: app.web.openai_api)."""


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
