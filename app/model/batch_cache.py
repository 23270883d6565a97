"""Per-sequence model state for the batching engine: one slot per running request.

The text model of MiniCPM-V 4.6 and 4.7 mixes gated-DeltaNet layers (a fixed-size conv state and
recurrent state per sequence) with full-attention layers (keys and values growing by one column per
token). Every
layer's state lives here in one tensor per layer, indexed by slot, so any set of sequences can decode
together whatever their lengths:

- requests admitted together are prefilled together, left-padded to one length (padding is masked
  out, and the DeltaNet layers zero it, so each row's state is what it would be alone, up to rounding),
  and each row's state is written into a free slot;
- a decode step runs slots [0, n) together; each slot writes its new key and value at its own column
  (its length), and an attention mask limits each slot to its own columns;
- a finished slot is filled with the last running one, so running slots stay dense.

The views below implement the part of transformers' Cache interface that the Qwen3.5 text layers call.
Tensors keep their addresses between steps (writes are in place), which CUDA graph replay relies on.
"""

from dataclasses import dataclass

import torch

from app.model.text.rows import in_one_copy

# Slots whose states are copied together when kept or restored (SlotStore.snapshots, restore): the copy's room
# on the GPU beside the kept blocks is 19 MB a slot at the 4.6 shape, and 12 KB a token.
SNAPSHOT_SLOTS = 32
# A restore joins the keys and values of consecutive snapshots up to this many bytes, to write each layer's in one
# copy rather than one a snapshot (launched one at a time, they left the GPU idle: docs/DECISIONS.md D61); joined
# whole, those of 32 long conversations would take hundreds of MB more.
RESTORE_JOINED_BYTES = 128 * 2**20


class SlotStore:
    def __init__(self, device):
        self.device = device
        self.slot_capacity = 0
        self.column_capacity = 0
        self.keys: dict[int, torch.Tensor] = {}  # layer -> [slots, kv heads, columns, head dim]
        self.values: dict[int, torch.Tensor] = {}
        self.conv: dict[int, torch.Tensor] = {}  # layer -> [slots, channels, kernel]
        self.recurrent: dict[int, torch.Tensor] = {}  # layer -> [slots, heads, key dim, value dim]
        self.lengths = torch.zeros(0, dtype=torch.long, device=device)  # tokens held per slot
        # What a slot adds to a new token's text position for its M-RoPE position (MiniCPM-V 4.7 lays a
        # prompt's images out on canvases, so positions run ahead of token counts; 0 for 4.6).
        self.rope_deltas = torch.zeros(0, dtype=torch.long, device=device)
        self.generation = 0  # bumped whenever tensors are reallocated (captured graphs become stale)

    def reserve(self, slots: int, columns: int) -> None:
        """Room for `slots` sequences of up to `columns` tokens; grows by doubling, keeps contents."""
        if slots <= self.slot_capacity and columns <= self.column_capacity:
            return
        new_slots = self.slot_capacity if slots <= self.slot_capacity else _grown(self.slot_capacity, slots)
        new_columns = self.column_capacity if columns <= self.column_capacity else _grown(self.column_capacity, columns)
        self.generation += 1  # first: a growth cut short (out of memory) has moved some layers' tensors already
        for states in (self.keys, self.values):
            for layer, old in states.items():
                states[layer] = _resized(old, (new_slots, old.shape[1], new_columns, old.shape[3]))
        for states in (self.conv, self.recurrent):
            for layer, old in states.items():
                states[layer] = _resized(old, (new_slots, *old.shape[1:]))
        self.lengths = _resized(self.lengths, (new_slots,))
        self.rope_deltas = _resized(self.rope_deltas, (new_slots,))
        self.slot_capacity, self.column_capacity = new_slots, new_columns

    def column_bytes(self) -> int:
        """Bytes one column of one slot takes: a token's keys and values in every full-attention layer."""
        return sum(t[0, :, 0].numel() * t.element_size() for states in (self.keys, self.values) for t in states.values())

    def ensure_layer(self, states: dict, layer: int, like: torch.Tensor, columns: bool) -> torch.Tensor:
        """The layer's tensor, created at first use with the shape and dtype of one sequence's state."""
        if layer not in states:
            shape = (self.slot_capacity, like.shape[1], self.column_capacity, like.shape[3]) if columns \
                else (self.slot_capacity, *like.shape[1:])
            states[layer] = torch.zeros(shape, dtype=like.dtype, device=self.device)
            self.generation += 1
        return states[layer]

    def move(self, sources: list[int], targets: list[int], columns: int | None = None) -> None:
        """Copy slot sources[i] into slot targets[i], for every i at once (no target is a source), without
        waiting for the GPU; keys and values up to `columns`, the most any source holds (all by default).
        One copy per layer for a whole batch of moves: the requests of a batch tend to end together (200 at
        once, as the benchmarks' replies of one length do), and a layer's copy per move, each first reading
        the slot's length back from the GPU, kept the scheduler's thread from the GPU."""
        source, target = in_one_copy([torch.tensor(sources), torch.tensor(targets)], self.device)
        columns = self.column_capacity if columns is None else min(columns, self.column_capacity)
        for states in (self.keys, self.values):
            for tensor in states.values():
                tensor[target, :, :columns] = tensor[source, :, :columns]
        for states in (self.conv, self.recurrent):
            for tensor in states.values():
                tensor[target] = tensor[source]
        self.lengths[target] = self.lengths[source]
        self.rope_deltas[target] = self.rope_deltas[source]

    def snapshots(self, slots: list[int], columns: list[int]) -> list["StateSnapshot"]:
        """A copy of what each slot slots[i] holds after its first columns[i] tokens (it must hold exactly
        those): every layer's state, to go on from later (restore), in one block of bytes a slot. The copies
        go SNAPSHOT_SLOTS slots at once, one a layer: the DeltaNet layers' states, the same size for every
        slot, and the attention layers' keys and values, each slot's own columns gathered token by token;
        then each slot's block is joined from both. A copy a layer and slot, 61 at the 4.6 shape, was a third
        of a text-only prefill wave's time on the scheduler's thread."""
        layout = _StateLayout.of(self)
        taken = []
        for first in range(0, len(slots), SNAPSHOT_SLOTS):
            some, lengths = slots[first:first + SNAPSHOT_SLOTS], columns[first:first + SNAPSHOT_SLOTS]
            count, total = len(some), sum(lengths)
            index, token_slots, token_columns = in_one_copy([torch.tensor(some), *_token_places(some, lengths)], self.device)
            wave = torch.empty((count, layout.nbytes), dtype=torch.uint8, device=self.device)
            for states, layer, offset, shape, dtype in layout.parts(self):
                wave[:, offset:offset + _bytes(shape, dtype)] = states[layer].index_select(0, index).view(count, -1).view(torch.uint8)
            tokens = torch.empty((total, layout.token_bytes), dtype=torch.uint8, device=self.device)
            for states, layer, offset, shape, dtype in layout.token_parts(self):
                tokens[:, offset:offset + _bytes(shape, dtype)] = \
                    states[layer][token_slots, :, token_columns].flatten(1).view(torch.uint8)
            rope_deltas = self.rope_deltas.index_select(0, index)
            at = 0
            for row, length in enumerate(lengths):
                block = torch.cat([wave[row], tokens[at:at + length].view(-1)])
                taken.append(StateSnapshot(length, layout, block, rope_deltas[row]))
                at += length
        return taken

    def restore(self, snapshots: list["StateSnapshot"], slots: list[int]) -> None:
        """Put snapshots[i] into slot slots[i], which then holds its tokens (room for them reserved first);
        the DeltaNet layers' states of SNAPSHOT_SLOTS of them at once, one copy a layer, then their keys and
        values, one copy a layer for each run of them up to RESTORE_JOINED_BYTES."""
        for first in range(0, len(slots), SNAPSHOT_SLOTS):
            self._restore(snapshots[first:first + SNAPSHOT_SLOTS], slots[first:first + SNAPSHOT_SLOTS])

    def _restore(self, snapshots: list["StateSnapshot"], slots: list[int]) -> None:
        count = len(slots)
        index, columns = in_one_copy([torch.tensor(slots), torch.tensor([s.columns for s in snapshots])], self.device)
        layout = snapshots[0].layout  # one model's: the same for all
        saved = torch.stack([snapshot.states for snapshot in snapshots])
        for states, layer, offset, shape, dtype in layout.parts(self):
            target = self._layer(states, layer, shape, dtype, columns=False)
            target[index] = saved[:, offset:offset + _bytes(shape, dtype)].view(dtype).view(count, *shape)
        del saved  # before the keys and values are joined: the two at once would raise the restore's peak
        parts = [(self._layer(states, layer, shape, dtype, columns=True), slice(offset, offset + _bytes(shape, dtype)),
                  shape, dtype) for states, layer, offset, shape, dtype in layout.token_parts(self)]
        for first, last in _joined_runs([snapshot.tokens.numel() for snapshot in snapshots], RESTORE_JOINED_BYTES):
            some = snapshots[first:last]
            tokens = some[0].tokens if len(some) == 1 else torch.cat([snapshot.tokens for snapshot in some])
            token_slots, token_columns = in_one_copy(list(_token_places(slots[first:last], [s.columns for s in some])),
                                                     self.device)
            for target, part, shape, dtype in parts:
                target[token_slots, :, token_columns] = tokens[:, part].view(dtype).view(-1, *shape)
        self.lengths[index] = columns
        self.rope_deltas[index] = torch.stack([snapshot.rope_delta for snapshot in snapshots])

    def _layer(self, states: dict, layer: int, shape: tuple, dtype, columns: bool) -> torch.Tensor:
        """The layer's tensor, made again (from one slot's state `shape`: (heads, head dim) for keys and values) if
        the store was released since (a warm-up's end): the model, and so what a snapshot holds, is the same."""
        if layer in states:
            return states[layer]
        like = torch.empty((1, shape[0], 1, shape[1]) if columns else (1, *shape), dtype=dtype, device=self.device)
        return self.ensure_layer(states, layer, like, columns)

    def release(self) -> None:
        """Free all memory (the model is being unloaded, or a warm-up is done with it)."""
        generation = self.generation
        self.__init__(self.device)
        self.generation = generation + 1  # never back to a number a captured graph was made at


@dataclass(frozen=True)
class _StateLayout:
    """How a snapshot's block of bytes holds one slot's state: first each DeltaNet layer's convolution and
    recurrent state (`entries`: kind, layer, offset, shape, dtype; `nbytes` in all), then a row of
    `token_bytes` a token, each attention layer's key and value for it (`token_entries`: kind, layer,
    offset in the row, (heads, head dim), dtype). Parts are 64-byte aligned, a row's 16."""

    entries: tuple
    nbytes: int
    token_entries: tuple
    token_bytes: int

    @classmethod
    def of(cls, store: SlotStore) -> "_StateLayout":
        return cls(*_laid_out(store, ("conv", "recurrent"), lambda tensor: tuple(tensor.shape[1:]), 64),
                   *_laid_out(store, ("keys", "values"), lambda tensor: (tensor.shape[1], tensor.shape[3]), 16))

    def parts(self, store: SlotStore):
        """(the store's dict of that kind, layer, offset, shape, dtype) for each DeltaNet part."""
        return _in_store(store, self.entries)

    def token_parts(self, store: SlotStore):
        """The same for each part of a token's row."""
        return _in_store(store, self.token_entries)


def _laid_out(store: SlotStore, kinds: tuple, shape_of, alignment: int) -> tuple[tuple, int]:
    """(kind, layer, offset, shape, dtype) for each layer of the store's `kinds`, one after another with its
    `shape_of(tensor)`, each part `alignment`-byte aligned; and the bytes of all."""
    entries, offset = [], 0
    for kind in kinds:
        for layer, tensor in getattr(store, kind).items():
            shape = shape_of(tensor)
            entries.append((kind, layer, offset, shape, tensor.dtype))
            offset += _aligned(_bytes(shape, tensor.dtype), alignment)
    return tuple(entries), offset


def _in_store(store: SlotStore, entries: tuple):
    for kind, layer, offset, shape, dtype in entries:
        yield getattr(store, kind), layer, offset, shape, dtype


def _bytes(shape, dtype) -> int:
    return torch.Size(shape).numel() * dtype.itemsize


def _aligned(size: int, alignment: int) -> int:
    return -(-size // alignment) * alignment


def _joined_runs(sizes: list[int], limit: int) -> list[tuple[int, int]]:
    """[first, last) runs of consecutive items whose sizes add up to at most `limit` (an item past it alone)."""
    runs, first, total = [], 0, 0
    for at, size in enumerate(sizes):
        if at > first and total + size > limit:
            runs.append((first, at))
            first, total = at, 0
        total += size
    return runs + [(first, len(sizes))] if sizes else runs


def _token_places(slots: list[int], lengths: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The slot and the column of each token held by slots[i]'s first lengths[i] columns, slot by slot."""
    counts = torch.tensor(lengths)
    return torch.tensor(slots).repeat_interleave(counts), \
        torch.arange(int(counts.sum())) - torch.tensor([0] + lengths[:-1]).cumsum(0).repeat_interleave(counts)


@dataclass(eq=False)
class StateSnapshot:
    """One sequence's state after its first `columns` tokens (SlotStore.snapshots), in one block of bytes
    laid out by `layout`."""

    columns: int
    layout: _StateLayout
    block: torch.Tensor
    rope_delta: torch.Tensor

    @property
    def states(self) -> torch.Tensor:
        """The DeltaNet layers' part of the block."""
        return self.block[:self.layout.nbytes]

    @property
    def tokens(self) -> torch.Tensor:
        """The keys and values: a row of bytes a token [columns, layout.token_bytes]."""
        return self.block[self.layout.nbytes:].view(self.columns, self.layout.token_bytes)

    @property
    def conv(self) -> dict:
        """Layer -> its convolution state, a view of the block."""
        return self._views("conv")

    @property
    def recurrent(self) -> dict:
        """Layer -> its recurrent state, a view of the block."""
        return self._views("recurrent")

    @property
    def keys(self) -> dict:
        """Layer -> its keys [heads, columns, head dim], a view of the block."""
        return self._token_views("keys")

    @property
    def values(self) -> dict:
        return self._token_views("values")

    def _views(self, kind: str) -> dict:
        return {layer: self.states[offset:offset + _bytes(shape, dtype)].view(dtype).view(shape)
                for part, layer, offset, shape, dtype in self.layout.entries if part == kind}

    def _token_views(self, kind: str) -> dict:
        return {layer: self.tokens[:, offset:offset + _bytes(shape, dtype)].view(dtype).view(self.columns, *shape).transpose(0, 1)
                for part, layer, offset, shape, dtype in self.layout.token_entries if part == kind}

    @property
    def nbytes(self) -> int:
        return self.block.numel()


def _grown(current: int, needed: int) -> int:
    size = max(current, 1)
    while size < needed:
        size *= 2
    return size


def _resized(old: torch.Tensor, shape: tuple) -> torch.Tensor:
    new = torch.zeros(shape, dtype=old.dtype, device=old.device)
    new[tuple(slice(0, size) for size in old.shape)] = old
    return new


class _CacheView:
    """What the text layers ask of a cache; subclasses say which slots a forward pass covers."""

    def __init__(self, store: SlotStore):
        self.store = store

    def is_recording_past(self, layer_idx: int) -> bool:
        return False


class PrefillCache(_CacheView):
    """Fresh sequences run together from their first token, left-padded to one length; row i lands in
    slot `first_slot + i` with its `lengths[i]` real tokens (the last ones of its row)."""

    def __init__(self, store: SlotStore, first_slot: int, lengths: list[int]):
        super().__init__(store)
        # A range, not a list of slots: indexing with a list copies it to the GPU and waits for the GPU
        # first, twice per DeltaNet layer (36 waits in a wave).
        self.slots = slice(first_slot, first_slot + len(lengths))
        self.lengths = lengths

    def get_conv_state(self, layer_idx: int, state_idx: int = 0):
        return None  # fresh sequences: the layer runs its prefill path

    def get_recurrent_state(self, layer_idx: int, state_idx: int = 0):
        return None

    def update_conv_state(self, conv_states: torch.Tensor, layer_idx: int, state_idx: int = 0,
                          conv_kernel_size: int | None = None, **kwargs) -> torch.Tensor:
        # Padding inputs are zeroed by the layer, so a short row's tail holds zeros where it would alone.
        kernel = conv_kernel_size or conv_states.shape[-1]
        tail = conv_states[..., -kernel:]
        if tail.shape[-1] < kernel:
            tail = torch.nn.functional.pad(tail, (kernel - tail.shape[-1], 0))
        self.store.ensure_layer(self.store.conv, layer_idx, tail, columns=False)[self.slots] = tail
        return conv_states

    def update_recurrent_state(self, recurrent_states: torch.Tensor, layer_idx: int, state_idx: int = 0, **kwargs):
        self.store.ensure_layer(self.store.recurrent, layer_idx, recurrent_states, columns=False)[self.slots] = recurrent_states
        return recurrent_states

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        keys = self.store.ensure_layer(self.store.keys, layer_idx, key_states, columns=True)
        values = self.store.ensure_layer(self.store.values, layer_idx, value_states, columns=True)
        padded = key_states.shape[2]
        for row, length in enumerate(self.lengths):
            slot = self.slots.start + row
            keys[slot, :, :length] = key_states[row, :, padded - length:]
            values[slot, :, :length] = value_states[row, :, padded - length:]
        return key_states, value_states


class DecodeCache(_CacheView):
    """Slots [0, n) advancing by one token each; slot i writes at column `positions[i]`."""

    def __init__(self, store: SlotStore, n: int, positions: torch.Tensor):
        super().__init__(store)
        self.n = n
        self.rows = torch.arange(n, device=store.device)
        self.positions = positions

    def get_conv_state(self, layer_idx: int, state_idx: int = 0):
        return self.store.conv[layer_idx][: self.n]  # updated in place by the layer

    def get_recurrent_state(self, layer_idx: int, state_idx: int = 0):
        return self.store.recurrent[layer_idx][: self.n]

    def update_recurrent_state(self, recurrent_states: torch.Tensor, layer_idx: int, state_idx: int = 0, **kwargs):
        state = self.store.recurrent[layer_idx][: self.n]
        state.copy_(recurrent_states)
        return state

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        keys = self.store.keys[layer_idx]
        values = self.store.values[layer_idx]
        keys[self.rows, :, self.positions] = key_states[:, :, 0]
        values[self.rows, :, self.positions] = value_states[:, :, 0]
        return keys[: self.n], values[: self.n]
