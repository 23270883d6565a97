"""What the engine's two caches in GPU memory share (app.engine.conversations' kept states and
app.engine.encoded_images' features): entries by key, least recently used first, their bytes counted against a
capacity, one lock between the request threads and the scheduler's. No torch at import, as everywhere in
app.engine."""

import threading
from collections import OrderedDict


class BoundedCache:
    """Entries by key in self._kept, least recently used first, self._held bytes of them, up to capacity_bytes
    (0 turns the cache off); self._lock guards both."""

    def __init__(self, capacity_bytes: int):
        self.capacity_bytes = capacity_bytes
        self._kept: OrderedDict = OrderedDict()
        self._held = 0
        self._lock = threading.Lock()

    @property
    def enabled(self) -> bool:
        return self.capacity_bytes > 0

    @property
    def held_bytes(self) -> int:
        return self._held

    def __len__(self) -> int:
        return len(self._kept)
