"""The one exception type whose message is meant for the user."""


class UserError(ValueError):
    """Bad input or an unmet limit: shown to the user as is, and the app keeps serving."""


class Busy(UserError):
    """The wait line is full: the demo is busy (the request is counted as turned away, not as an error)."""


class ModelUnavailable(UserError):
    """The model cannot be found locally nor fetched: the app cannot start."""
