"""Ending a reply from another thread, at once."""

import threading


class StopSignal:
    """Set from any thread to end a reply: the web side sets it when its client cancels (Stop, a job
    cancelled, a client gone), also while the reply's own thread is waiting for the engine's next event,
    which a cancelled Gradio generator cannot be told (app.ui.cancellable)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._listeners: list | None = []  # None once set

    def set(self) -> None:
        with self._lock:
            listeners, self._listeners = self._listeners, None
        for listener in listeners or ():
            listener()

    @property
    def is_set(self) -> bool:
        return self._listeners is None

    def on_set(self, listener) -> None:
        """Call `listener()` when the signal is set (at once if it already is)."""
        with self._lock:
            if self._listeners is not None:
                self._listeners.append(listener)
                return
        listener()
