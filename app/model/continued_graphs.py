"""The fused text model's continued prefill (a follow-up's new turn, and a kept prompt's rest, going on from the
states in its slot: app.engine.conversations) captured as CUDA graphs, one per (prompts, padded length, columns
read), replayed as app.model.cuda_graphs' prefills are, for their reason."""

import logging

import torch

from app.model.cuda_graphs import GraphSet, graph_length, in_pieces
from app.model.text.rows import GROUP_AREA

log = logging.getLogger(__name__)

# Waves a captured continued prefill exists for (prompts going on from kept states: a follow-up's new turn,
# and every prompt's generation prompt after its state is kept; app.engine.conversations), by their prompts'
# count: the lengths they are padded to. Large waves for the generation prompts (a few tokens each), which
# else would add a wave's launches from Python to every large wave, and for 8 or 16 follow-ups' new turns. A
# wave whose count has a length for its prompts but whose columns pass the limits below is cut in halves that
# fit them (64 generation prompts, one over 2,048 tokens: two graphs of 32), padded no further, rather than
# launched from Python. From 128 tokens on each length is at most half again the one before, so that a new turn
# past 128 is padded by at most half: a chat reply of 128 tokens and a question make a turn of about 160, which
# went to 256 (docs/DECISIONS.md D64).
_TURN_LENGTHS = (16, 64, 128, 192, 256, 384, 512, 768, 1024)
CONTINUED_GRAPH_LENGTHS = {1: _TURN_LENGTHS, 2: _TURN_LENGTHS, 4: _TURN_LENGTHS, 8: (16, 64, 128, 192, 256),
                           16: (16, 128, 192, 256), 32: (16,), 64: (16,)}
# The columns a captured continued prefill is made for: the fewest that hold its prompts of 2,048, 4,096, ... (at
# most the store's). On CUDA its attention reads each slot's columns up to each row's own, however many that is
# (D61); PyTorch's version gathers all of them, so a conversation past 2,048 tokens replays graphs of its own
# (captured at warm-up up to the store's columns), in pieces that would gather no more keys and values than 64
# prompts over 2,048 columns. Those limits predate D61 and still shape the graphs captured.
CONTINUED_GRAPH_COLUMNS = 2048


class ContinuedPrefillGraphs(GraphSet):
    """The fused text model's continued prefill (FusedTextModel.prefill_continued_padded) captured as a CUDA
    graph per (prompts, padded length, columns read) of CONTINUED_GRAPH_LENGTHS, for PrefillGraphs' reason:
    launched from Python, a few tokens' prefill is tens of ms of launches. Its prompts are padded at their end,
    through which every state goes unchanged."""

    given_up = False

    def __init__(self, store, fused):
        super().__init__(store)
        self.fused = fused
        self.refused: set = set()  # buckets with no memory to capture: launched from Python, not tried again

    def clear(self) -> None:
        super().clear()
        self.refused.clear()

    def capture_all(self, max_rows: int) -> None:
        """Capture every bucket that fits the store now, over each number of columns a conversation within it may
        need read (one first met while serving would stall every stream for its capture), each with a throwaway
        prompt in the first slots that reaches the last of those columns."""
        hidden, dtype = self.fused.embed.embedding_dim, self.fused.embed.weight.dtype
        columns = min(CONTINUED_GRAPH_COLUMNS, self.store.column_capacity)
        while columns <= self.store.column_capacity:
            for rows, lengths in CONTINUED_GRAPH_LENGTHS.items():
                for length in lengths:
                    if rows > max_rows or length > columns or self.given_up:
                        continue
                    starts = [columns - length] * rows
                    if self._bucket([1] * rows, starts, length):  # else run in halves, captured on their own
                        self.run(torch.zeros((rows, hidden), dtype=dtype, device=self.store.device), [1] * rows,
                                 starts, list(range(rows)), length)
            columns *= 2

    def run(self, embeddings: torch.Tensor, lengths: list[int], starts: list[int], slots: list[int],
            length: int | None = None) -> torch.Tensor | None:
        """FusedTextModel.prefill_continued's logits through captured graphs, a graph (captured now if need be)
        for each piece of 2^k prompts (halved where only its columns stand in the way), or None where a piece
        has no bucket or capturing failed (then no piece has run: the prompts' slots are as they were)."""
        if self.given_up:
            return None
        return in_pieces(embeddings, lengths, lambda start, end: self._bucket(lengths[start:end], starts[start:end], length),
                         lambda piece, start, end, bucket: self._ready(piece, lengths[start:end], starts[start:end],
                                                                       slots[start:end], bucket),
                         halve=lambda start, end: graph_length(CONTINUED_GRAPH_LENGTHS, lengths[start:end]) is not None)

    def _bucket(self, lengths: list[int], starts: list[int], length: int | None) -> tuple[int, int] | None:
        """The length a piece of prompts of `lengths` going on after `starts` is padded to and the columns its
        attention reads, if a graph for it can be captured."""
        length = length or graph_length(CONTINUED_GRAPH_LENGTHS, lengths)
        if length is None:
            return None
        reach = max(starts) + length
        columns = min(max(CONTINUED_GRAPH_COLUMNS, 1 << (reach - 1).bit_length()), self.store.column_capacity)
        # No more keys and values than 64 prompts over 2,048 columns, and a mask within the packed prefill's
        # (GROUP_AREA places), as PyTorch's version of its attention would gather (CONTINUED_GRAPH_COLUMNS).
        too_much = len(lengths) * columns > max(CONTINUED_GRAPH_LENGTHS) * CONTINUED_GRAPH_COLUMNS \
            or len(lengths) * length * columns > GROUP_AREA
        refused = (len(lengths), length, columns) in self.refused
        return None if reach > columns or too_much or refused else (length, columns)

    def _ready(self, embeddings: torch.Tensor, lengths: list[int], starts: list[int], slots: list[int],
               bucket: tuple[int, int]) -> tuple | None:
        """The piece's graph and its output, its inputs in place (the graph captured now if need be: that leaves
        the slots' states as they were), or None if capturing failed."""
        rows, (length, columns) = len(lengths), bucket
        self._drop_if_stale()
        captured = self.captured.get((rows, length, columns))
        if captured is None:
            static_embeddings = torch.zeros((rows * length, embeddings.shape[1]), dtype=embeddings.dtype,
                                            device=self.store.device)
            static_places = torch.zeros(3 * rows, dtype=torch.long, device=self.store.device)  # lengths, starts, slots
        else:
            static_embeddings, static_places, graph, static_logits = captured
        static_places.copy_(torch.tensor(lengths + starts + slots).pin_memory(), non_blocking=True)
        static_embeddings.zero_()
        padded, at = static_embeddings.view(rows, length, -1), 0
        for row, size in enumerate(lengths):
            padded[row, :size] = embeddings[at:at + size]
            at += size
        if captured is None:
            captured = self._capture_bucket(static_embeddings, static_places, rows, length, columns)
            if captured is None:
                return None
        return captured[2:]

    def _capture_bucket(self, static_embeddings, static_places, rows: int, length: int, columns: int):
        # Each run goes on from the prompts' slots and moves their states on: the warm-up runs' effect is undone
        # before the replay that counts.
        slots = static_places[2 * rows:]
        saved = [{layer: t.index_select(0, slots) for layer, t in states.items()}
                 for states in (self.store.conv, self.store.recurrent)]
        graph = out_of_memory = None
        try:
            graph, static_logits = self._capture(
                lambda: self.fused.prefill_continued_padded(static_embeddings, static_places[:rows],
                                                            static_places[rows:2 * rows], slots, columns),
                f"the continued prefill of {rows} prompts of up to {length} tokens over {columns} columns")
        except RuntimeError as error:  # torch.cuda.OutOfMemoryError is one
            out_of_memory = _out_of_memory(error)
            if out_of_memory:  # a bucket first met while serving: this one is launched from now on, not the rest
                log.warning("No memory to capture the continued prefill of %d prompts of up to %d tokens over %d "
                            "columns; launched from Python", rows, length, columns)
                self.refused.add((rows, length, columns))
            else:
                log.warning("The continued prefill cannot be captured as a CUDA graph (%s); it is launched from Python", error)
                self.given_up = True
        finally:  # the warm-up runs may have run even where the capture then failed
            for states, kept in zip((self.store.conv, self.store.recurrent), saved):
                for layer, state in kept.items():
                    states[layer].index_copy_(0, slots, state)
        if graph is None:
            if out_of_memory:
                torch.cuda.empty_cache()  # here, not in the handler, whose traceback held the failed allocations
            return None
        self.captured[rows, length, columns] = (static_embeddings, static_places, graph, static_logits)
        self.store_generation = self.store.generation
        return self.captured[rows, length, columns]


def _out_of_memory(error: RuntimeError) -> bool:
    """Whether a capture failed for want of GPU memory: PyTorch's allocator raises OutOfMemoryError, cuBLAS and
    Triton plain RuntimeErrors that say so."""
    return isinstance(error, torch.cuda.OutOfMemoryError) or "out of memory" in str(error).lower() \
        or "ALLOC_FAILED" in str(error)
