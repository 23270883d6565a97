"""Images' visual features kept after they are encoded, so that an earlier turn's image is neither decoded nor
encoded again where its conversation's kept state (app.engine.conversations) is not there to go on from.

That is: a conversation started again from its first turn, whose state at that point was let go once newer
ones filled the cache; a follow-up or a Retry after its conversation's state was let go; an API client that
sends a conversation's whole history, images included, with each request (the API names a file by its bytes'
hash, app.web.data_urls) in a form its kept state does not match. The features of a 1344x1344 image at the 4.6
shape are 1.3 MB, against 26 MB of kept state, so many more are held.

As for kept conversations, only images of the conversation's earlier turns are taken from here, never those of
its last question (app.engine.inputs, docs/SECURITY.md). A request whose every such image is held here, or in
the kept state it goes on from, is prepared without decoding them (PreparedInputs.pixels_left_out) and takes
their features from here; any other request decodes and encodes all its images, and the features of each are
kept. Keys are app.engine.conversations.image_key (the file's identity, how it is cut and encoded). The least
recently used go first past tuning.ENCODED_IMAGES_MB; all go with the model (a new cache for each one loaded).
docs/DECISIONS.md D56. No torch at import, as everywhere in app.engine.
"""

from app.engine.bounded_cache import BoundedCache
from app.engine.conversations import file_identity
from app.engine.request_media import media_paths


class EncodedImages(BoundedCache):
    """Features by image key, least recently used first, up to `capacity_bytes`. Used from the request threads
    (held, take) and the scheduler's (keep)."""

    def __init__(self, capacity_bytes: int):
        super().__init__(capacity_bytes)  # self._kept: features by image key
        self._by_file: dict[str, set[str]] = {}  # a file's identity -> the keys held of it

    def held(self, files: set[str]) -> frozenset:
        """The keys held of these files (their identities): a preparer need not decode those images, if they are
        still held when taken."""
        with self._lock:
            return frozenset(key for file in files for key in self._by_file.get(file, ()))

    def take(self, keys: list[str], rows: list[int]) -> list | None:
        """The features of every key, each now the most recently used; None if any is not held, or not of the
        rows (visual tokens) given for it (then none is taken: the request decodes and encodes all its images)."""
        with self._lock:
            if not all(key in self._kept and self._kept[key].shape[0] == count for key, count in zip(keys, rows)):
                return None
            for key in keys:
                self._kept.move_to_end(key)
            return [self._kept[key] for key in keys]

    def keep(self, key: str, features) -> None:
        """Hold an image's features (a tensor of its own), letting the least recently used go past the capacity."""
        if features.nbytes > self.capacity_bytes:
            return
        with self._lock:
            self._drop(key)
            self._kept[key] = features
            self._by_file.setdefault(_file_of(key), set()).add(key)
            self._held += features.nbytes
            while self._held > self.capacity_bytes:
                self._drop(next(iter(self._kept)))

    def _drop(self, key: str) -> None:
        dropped = self._kept.pop(key, None)
        if dropped is not None:
            self._held -= dropped.nbytes
            keys = self._by_file[_file_of(key)]
            keys.discard(key)
            if not keys:
                del self._by_file[_file_of(key)]

    def clear(self) -> None:
        with self._lock:
            self._kept.clear()
            self._by_file.clear()
            self._held = 0


def _file_of(key: str) -> str:
    """The file identity an image key starts with (conversations.image_key: the identity, then how the image is
    cut and encoded)."""
    return key.rsplit("|", 2)[0]


def held_media(messages: list[dict], conversations, images: EncodedImages) -> frozenset:
    """The keys of the media of this request's earlier turns that kept conversations or `images` hold: what
    its preparer is told (app.engine.inputs). No key where its last question holds an image or a video (then
    all its media are decoded) or no earlier turn holds one, so that a request's preparer is not sent every key
    held."""
    if not messages or any(part["type"] in ("image", "video") for part in messages[-1]["content"]):
        return frozenset()
    files = set()
    for path in media_paths(messages[:-1], "image") + media_paths(messages[:-1], "video"):
        try:
            files.add(file_identity(path))
        except OSError:  # gone: its preparation says so
            pass
    return conversations.held_media() | images.held(files) if files else frozenset()


def _images_after_kept(prepared) -> list[tuple[str, int]]:
    """(key, visual tokens) of each of the request's images that its kept conversation (if any) does not hold,
    in prompt order: the images its features are, or are made from."""
    images = len(prepared.image_views)
    kept_length = prepared.kept.length if prepared.kept is not None else 0
    return [(key, tokens) for key, end, tokens in zip(prepared.media_keys[:images], prepared.media_ends[:images],
                                                      prepared.image_tokens) if end > kept_length]


def take_held_media(prepared, cache: EncodedImages) -> bool:
    """For a request prepared without its media's pixels: whether its media are all still held, a video by its
    kept conversation, images by that and `cache`; if so, the features of the images its conversation does not
    hold are taken into prepared.image_features (held by the request from now on, whatever the cache lets go)."""
    if prepared.video_tokens:  # only its kept conversation holds a video's features
        return prepared.kept is not None and prepared.media_ends[-1] <= prepared.kept.length
    rest = _images_after_kept(prepared)
    if not rest:  # its kept conversation holds them all (no kept conversation: where each image lies is unknown)
        return prepared.kept is not None
    features = cache.take([key for key, _ in rest], [tokens for _, tokens in rest])
    prepared.image_features = features
    return features is not None


def wave_features(wave: list, encoded: list, cache: EncodedImages, runner) -> list:
    """Each request of a wave's visual features for its prefill: those encoded now, each image's kept in
    `cache`, or those its preparation took from the cache (joined on the GPU by `runner`)."""
    features = []
    for request, feature in zip(wave, encoded):
        prepared = request.prepared
        if feature is None and prepared.image_features:
            feature = runner.joined(prepared.image_features)
        elif feature is not None and cache.enabled and prepared.image_views and not prepared.video_tokens:
            images = _images_after_kept(prepared)
            if sum(tokens for _, tokens in images) == feature.shape[0]:  # else where each image's lie is unknown
                for (key, _), part in zip(images, runner.pieces(feature, [tokens for _, tokens in images]) or ()):
                    cache.keep(key, part)
        prepared.image_features = None
        features.append(feature)
    return features
