"""Where a request waits for the GPU: one at a time, first come first served, with a bounded line."""

import threading
from collections import deque
from typing import Iterator

from app import limits
from app.errors import UserError


class GpuGate:
    def __init__(self, max_waiting: int):
        self.max_waiting = max_waiting
        self._changed = threading.Condition()
        self._line: deque = deque()
        self._busy = False

    def join(self) -> object:
        """A ticket at the end of the line; the demo is busy (UserError, at once) when the line is full."""
        with self._changed:
            if len(self._line) >= self.max_waiting:
                raise UserError(limits.MSG_BUSY.format(waiting=len(self._line)))
            ticket = object()
            self._line.append(ticket)
            return ticket

    def wait_turn(self, ticket, timeout: float) -> bool:
        """True once `ticket` holds the GPU; False if `timeout` passed first (it stays in line)."""
        with self._changed:
            if self._changed.wait_for(lambda: not self._busy and self._line[0] is ticket, timeout):
                self._line.popleft()
                self._busy = True
                return True
            return False

    def line_up(self) -> Iterator[int]:
        """Join the line and wait for the GPU, yielding how many are ahead every half second.

        When the iteration ends the caller holds the GPU and must release() it; closing the iterator
        earlier gives the place up.
        """
        ticket = self.join()
        try:
            while not self.wait_turn(ticket, timeout=0.5):
                yield self.ahead_of(ticket)
        finally:
            self.leave(ticket)  # a no-op once admitted

    def ahead_of(self, ticket) -> int:
        with self._changed:
            return self._line.index(ticket) + (1 if self._busy else 0)

    def leave(self, ticket) -> None:
        """Give up a place in line (the request was cancelled while waiting)."""
        with self._changed:
            if ticket in self._line:
                self._line.remove(ticket)
                self._changed.notify_all()

    def release(self) -> None:
        with self._changed:
            self._busy = False
            self._changed.notify_all()

    @property
    def waiting(self) -> int:
        return len(self._line)
