"""CUDA graphs of the decode step (one per batch-size bucket) and of text prefills of few tokens (1, 2 or 4
prompts up to 1,024 tokens, up to 64 prompts of short ones; a wave of any other count runs as pieces of 2^k
prompts, a graph each): even fused, a step is a chain of a few hundred small kernels, and launching them from
Python would cost more than running them. Captured at warm-up, replayed while serving, and captured again only
when the slot store moves its tensors (app.model.batch_cache)."""

import functools
import logging
from typing import Callable

import torch

from app.model.text.rows import power_of_two_pieces

log = logging.getLogger(__name__)

# Batch sizes a captured decode step exists for; a batch runs in the smallest bucket that holds it.
GRAPH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512)
# Prefills a captured text prefill exists for (a wave runs as pieces of 2^k prompts), by their prompts' count: the
# lengths they are front-padded to, at most the store's reserved columns (a longer one would grow the store,
# and so recapture every graph). Large waves of short prompts (text chat, a small image) too: launched,
# their thousand kernels took longer than their GPU work (docs/DECISIONS.md D46); large waves of long
# prompts are bound by the GPU.
PREFILL_GRAPH_LENGTHS = {1: (64, 128, 256, 512, 768, 1024), 2: (64, 128, 256, 512, 768, 1024),
                         4: (64, 128, 256, 512, 768, 1024), 8: (64, 128, 256), 16: (64, 128, 256), 32: (64, 128),
                         64: (64, 128)}


@functools.cache
def capture_stream():
    """The one side stream every capture runs on, for the life of the process. cuBLAS keeps a workspace
    for each stream it has run on and never frees it (32 MiB on an H200): with a new stream per capture,
    0.87 GiB stayed allocated after a model switch unloaded everything (docs/DECISIONS.md D18)."""
    return torch.cuda.Stream()


class GraphSet:
    """Captured CUDA graphs of one kind, in one memory pool, valid while the store keeps its tensors."""

    def __init__(self, store):  # app.model.batch_cache.SlotStore
        self.store = store
        self.pool = None
        self.captured: dict = {}
        self.store_generation = None

    def clear(self) -> None:
        self.captured.clear()
        self.pool = None

    def _drop_if_stale(self) -> None:
        """Forget every capture if the store has moved its tensors since they were made."""
        if self.store_generation != self.store.generation:
            self.clear()
            self.store_generation = self.store.generation

    def _capture(self, run: Callable[[], torch.Tensor], name: str) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """`run` captured as a CUDA graph in this set's pool, with its output tensor. Two warm-up runs first,
        on the capture's side stream as capture requires (kernels tuned per shape run their tuning then,
        outside the capture)."""
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        started = torch.cuda.Event(enable_timing=True)
        ended = torch.cuda.Event(enable_timing=True)
        started.record()
        stream = capture_stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                run()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        # Thread-local: request threads copy pixels to the GPU meanwhile (stage_media), on their own stream.
        with torch.cuda.graph(graph, pool=self.pool, stream=stream, capture_error_mode="thread_local"):
            output = run()
        ended.record()
        torch.cuda.synchronize()
        log.info("Captured %s in %.0f ms", name, started.elapsed_time(ended))
        return graph, output


class PrefillGraphs(GraphSet):
    """The fused text prefill of waves of few tokens captured as a CUDA graph per (prompts, padded length).

    A lone prompt's text prefill is about a thousand kernels, launched from Python: 28-37 ms on an H200
    for about 4 ms of GPU work (flash-linear-attention's chunked delta rule alone goes through autograd,
    autocast and input checks 18 times; docs/DECISIONS.md D17). Replayed, the launches cost next to
    nothing. The prompts are front-padded with zero embeddings to the bucket's length
    (FusedTextModel.prefill_padded): their padding is computed but changes nothing, and the GPU had
    time to spare.
    """

    given_up = False  # a capture failed: every prefill is launched from Python

    def __init__(self, store, fused):  # fused: app.model.text.fused.FusedTextModel
        super().__init__(store)
        self.fused = fused

    def capture_all(self, max_rows: int) -> None:
        """Capture every bucket that fits the store now, each with a throwaway prompt into the first slots."""
        hidden = self.fused.embed.embedding_dim
        dtype = self.fused.embed.weight.dtype
        for rows, lengths in PREFILL_GRAPH_LENGTHS.items():
            for length in lengths:
                if rows <= max_rows and not self.given_up:
                    self.run(torch.zeros((rows, hidden), dtype=dtype, device=self.store.device), [1] * rows, 0,
                             length)

    def run(self, embeddings: torch.Tensor, lengths: list[int], first_slot: int,
            length: int | None = None) -> torch.Tensor | None:
        """FusedTextModel.prefill's logits through captured graphs, a graph (captured now if need be) for each
        piece of 2^k prompts, or None where a piece has no bucket or capturing failed. `length`: the bucket's,
        rather than the smallest that holds it."""
        if self.given_up:
            return None
        return in_pieces(embeddings, lengths, lambda start, end: self._bucket(lengths[start:end], length),
                         lambda piece, start, end, bucket: self._ready(piece, lengths[start:end], first_slot + start, bucket))

    def _bucket(self, lengths: list[int], length: int | None) -> int | None:
        """The length a piece of prompts of `lengths` is padded to, if a graph for it can be captured."""
        length = length or graph_length(PREFILL_GRAPH_LENGTHS, lengths)
        return None if length is None or length > self.store.column_capacity else length

    def _ready(self, embeddings: torch.Tensor, lengths: list[int], first_slot: int, length: int) -> tuple | None:
        """The piece's graph and its output, its inputs in place (the graph captured now if need be), or None if
        capturing failed."""
        rows = len(lengths)
        self._drop_if_stale()
        captured = self.captured.get((rows, length))
        if captured is None:
            device = self.store.device
            static_embeddings = torch.zeros((rows * length, embeddings.shape[1]), dtype=embeddings.dtype, device=device)
            static_places = torch.zeros(2 * rows, dtype=torch.long, device=device)  # padding, then slots
        else:
            static_embeddings, static_places, graph, static_logits = captured
        pads = [length - size for size in lengths]
        static_places.copy_(torch.tensor(pads + list(range(first_slot, first_slot + rows))).pin_memory(),
                            non_blocking=True)
        static_embeddings.zero_()
        padded, start = static_embeddings.view(rows, length, -1), 0
        for row, (pad, size) in enumerate(zip(pads, lengths)):
            padded[row, pad:] = embeddings[start:start + size]
            start += size
        if captured is None:
            # The warm-up runs write these prompts' own (free) slots, as the replay does next.
            try:
                graph, static_logits = self._capture(
                    lambda: self.fused.prefill_padded(static_embeddings, static_places[:rows],
                                                             static_places[rows:]),
                    f"the prefill of {rows} prompts of up to {length} tokens")
            except RuntimeError as error:  # a kernel that cannot be captured (a library's new version, say)
                log.warning("The prefill cannot be captured as a CUDA graph (%s); it is launched from Python", error)
                self.given_up = True
                return None
            self.captured[rows, length] = (static_embeddings, static_places, graph, static_logits)
            # The warm-up runs may have made the store's layers (its first prefill): no earlier capture can
            # have existed then, and this one uses them.
            self.store_generation = self.store.generation
        return graph, static_logits


def graph_length(lengths_by_count: dict, lengths: list[int]) -> int | None:
    """The shortest of the lengths `lengths_by_count` lists for len(lengths) prompts that holds each, or None."""
    return next((size for size in lengths_by_count.get(len(lengths), ()) if size >= max(lengths)), None)


def in_pieces(embeddings: torch.Tensor, lengths: list[int], bucket: Callable, ready: Callable,
              halve: Callable | None = None) -> torch.Tensor | None:
    """The logits of a prefill of prompts of `lengths` (their embeddings packed back to back) run as pieces of 2^k
    prompts, a captured graph each, or None where a piece has no bucket (`bucket(start, end)`: what the
    prompts start:end are padded to, or None) or its graph cannot be made ready (`ready(their embeddings, start,
    end, length)`: (graph, its output), its inputs in place, or None). A piece with no bucket for which
    `halve(start, end)` is true is cut in halves until each has one. Every graph is made ready before any is
    replayed: one that fails leaves no piece run. Pieces of one shape (halves) share a graph: the later ones'
    inputs are put in place after the one before has replayed."""
    pieces = []  # (first prompt, prompts, bucket, first embedding row)
    at = 0
    for start, rows in power_of_two_pieces(len(lengths)):
        for piece in _with_buckets(start, rows, bucket, halve):
            if piece is None:
                return None
            pieces.append((*piece, at))
            at += sum(lengths[piece[0]:piece[0] + piece[1]])

    def made_ready(start: int, rows: int, length, first_row: int):
        size = sum(lengths[start:start + rows])
        return ready(embeddings[first_row:first_row + size], start, start + rows, length)

    graphs, shapes = [], set()
    for start, rows, length, first_row in pieces:
        if (rows, length) in shapes:  # its inputs are put in place once the piece before has replayed
            graphs.append(lambda piece=(start, rows, length, first_row): made_ready(*piece))
            continue
        graphs.append(made_ready(start, rows, length, first_row))
        if graphs[-1] is None:
            return None
        shapes.add((rows, length))
    return replayed(graphs, len(lengths))


def _with_buckets(start: int, rows: int, bucket: Callable, halve: Callable | None):
    """(start, rows, bucket) of the piece of `rows` prompts from `start`, or of its halves (and theirs) where
    it has no bucket and `halve` says so; None for a piece that has none."""
    found = bucket(start, start + rows)
    if found is not None or rows == 1 or halve is None or not halve(start, start + rows):
        yield None if found is None else (start, rows, found)
        return
    yield from _with_buckets(start, rows // 2, bucket, halve)
    yield from _with_buckets(start + rows // 2, rows // 2, bucket, halve)


def replayed(ready: list, prompts: int) -> torch.Tensor:
    """Replay each piece's graph in turn ((graph, its output) pairs, their inputs in place, or for a piece that
    shares a graph with one before it, a function that puts its inputs in place and gives that pair): the
    logits of the `prompts` of all. Where there are several, each output is copied out before the next replay:
    graphs of one pool may reuse memory another's output lies in."""
    if len(ready) == 1:
        graph, logits = ready[0]
        graph.replay()
        return logits
    joined, at = None, 0
    for piece in ready:
        made = piece() if callable(piece) else piece
        if made is None:  # its graph was made ready moments ago, in this wave
            raise RuntimeError("A captured prefill graph was let go in the middle of its wave")
        graph, logits = made
        graph.replay()
        if joined is None:
            joined = torch.empty((prompts, logits.shape[1]), dtype=logits.dtype, device=logits.device)
        joined[at:at + logits.shape[0]].copy_(logits)
        at += logits.shape[0]
    return joined


class DecodeGraphs(GraphSet):
    """Captured decode steps, one per batch-size bucket, replayed with the batch padded to its bucket.

    Padding rows decode a dummy token at column 0 of free slots (what they write there is overwritten when a
    request takes the slot; the fused text model's delta rule leaves their DeltaNet states alone: docs/DECISIONS.md
    D60). Growing the store recaptures.
    """

    captures = True

    def __init__(self, store, step: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]):
        super().__init__(store)
        self.step = step  # the text backend's decode_step(tokens, positions)

    def run(self, tokens: torch.Tensor) -> torch.Tensor:
        """The step for slots [0, n) fed `tokens` [n], at the store's lengths; logits [n, vocab]."""
        n = tokens.shape[0]
        store = self.store
        bucket = next((size for size in GRAPH_BUCKETS if size >= n), None)
        if bucket is None:  # beyond the largest bucket: no graph, still correct
            return self.step(tokens.to(store.device), store.lengths[:n].clone())
        store.reserve(bucket, store.column_capacity)
        self._drop_if_stale()
        if bucket not in self.captured:
            self.captured[bucket] = self._capture_bucket(bucket)
        graph, static_tokens, static_positions, static_logits = self.captured[bucket]
        static_tokens.zero_()
        static_tokens[:n] = tokens
        static_positions.zero_()
        static_positions[:n] = store.lengths[:n]
        graph.replay()
        return static_logits[:n]

    def capture_all(self, max_rows: int, above: int = 0) -> None:
        """Capture the step of every bucket in (above, max_rows] (each run once)."""
        for bucket in GRAPH_BUCKETS:
            if above < bucket <= max_rows:
                self.run(torch.zeros(bucket, dtype=torch.long, device=self.store.device))

    def _capture_bucket(self, bucket: int):
        device = self.store.device
        static_tokens = torch.zeros(bucket, dtype=torch.long, device=device)
        static_positions = torch.zeros(bucket, dtype=torch.long, device=device)
        # The warm-up runs write column 0 and the DeltaNet states (the convolution's; the recurrent ones too through
        # transformers' layers) of the bucket's slots, some of which hold running requests: saved and restored.
        saved = self._save_column_zero(bucket)
        graph, static_logits = self._capture(lambda: self.step(static_tokens, static_positions),
                                             f"the decode step for batch {bucket}")
        self._restore(saved)
        return graph, static_tokens, static_positions, static_logits

    def _save_column_zero(self, bucket: int):
        """The state that capture warm-ups overwrite: every slot's column 0 and its DeltaNet states."""
        store = self.store
        return ({layer: (t[:bucket, :, 0].clone(), store.values[layer][:bucket, :, 0].clone()) for layer, t in store.keys.items()},
                {layer: t[:bucket].clone() for layer, t in store.conv.items()},
                {layer: t[:bucket].clone() for layer, t in store.recurrent.items()})

    def _restore(self, saved) -> None:
        store = self.store
        columns, conv, recurrent = saved
        for layer, (keys, values) in columns.items():
            bucket = keys.shape[0]
            store.keys[layer][:bucket, :, 0] = keys
            store.values[layer][:bucket, :, 0] = values
        for layer, state in conv.items():
            store.conv[layer][: state.shape[0]] = state
        for layer, state in recurrent.items():
            store.recurrent[layer][: state.shape[0]] = state
