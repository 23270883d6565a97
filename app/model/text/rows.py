"""Where each row of a forward pass of the fused text model (app.model.text.fused) belongs: its slot, its
column there and its rotary position, and how a prefill's prompts are laid out."""

import itertools
from dataclasses import dataclass

import torch


def power_of_two_pieces(count: int) -> list[tuple[int, int]]:
    """(first row, rows) of the pieces of 2^k rows, largest first, that `count` rows are cut into: 19 -> 16, 2, 1.
    Prefills of any number of prompts run as such pieces where their shapes must stay few (a captured graph
    per count, transformers' kernels compiled per shape: docs/DECISIONS.md D47)."""
    pieces, start = [], 0
    for bit in reversed(range(count.bit_length())):
        if count & (1 << bit):
            pieces.append((start, 1 << bit))
            start += 1 << bit
    return pieces


def in_one_copy(parts: list[torch.Tensor], device) -> list[torch.Tensor]:
    """1-D integer tensors of the CPU on `device`, in one pinned copy that does not wait for the GPU."""
    host = torch.cat(parts)
    if torch.device(device).type == "cuda":
        host = host.pin_memory()
    return list(host.to(device, non_blocking=True).split([len(part) for part in parts]))


# A packed prefill's prompts attend in padded groups (PackedAttention): a group may pad to at most GROUP_WASTE
# times its prompts' own attention area (each prompt's tokens x the columns it reads) plus GROUP_SLACK, and
# to at most GROUP_AREA places in all (prompts x length x columns; its mask is that many bools times the query
# heads sharing a key head: 64 MB at most at the 4.6 shape).
GROUP_WASTE = 1.25
GROUP_SLACK = 4096
GROUP_AREA = 2**24


@dataclass
class AttentionGroup:
    """Prompts of a packed prefill that attend together, each padded at its end to `length` rows, over
    their slots' first `columns` columns: `gather` takes each padded place's packed row (row 0 on
    padding), `sees` masks [prompts, length, columns], and `places` / `rows` put the real places' outputs
    back at their packed rows."""

    slots: torch.Tensor
    gather: torch.Tensor
    places: torch.Tensor
    rows: torch.Tensor
    sees: torch.Tensor
    length: int
    columns: int


@dataclass
class PackedAttention:
    """How a packed prefill's attention runs: groups of prompts of like lengths in one padded call each,
    instead of a call per prompt (with 25 prompts a wave, the calls were most of a prefill wave's time on
    the scheduler's thread), and the prompts that fit no group alone, as (slot, start, length, first
    packed row): a long prompt's causal attention needs no mask."""

    groups: list[AttentionGroup]
    alone: list[tuple[int, int, int, int]]

    @classmethod
    def planned(cls, lengths: list[int], starts: list[int], slots: list[int], device) -> "PackedAttention":
        firsts = list(itertools.accumulate([0, *lengths[:-1]]))
        order = sorted(range(len(lengths)), key=lambda i: starts[i] + lengths[i], reverse=True)
        members: list[list[int]] = []
        for prompt in order:
            group = (members[-1] if members else []) + [prompt]
            length = max(lengths[i] for i in group)
            columns = max(starts[i] + lengths[i] for i in group)
            own = sum(lengths[i] * (starts[i] + lengths[i]) for i in group)
            padded = len(group) * length * columns
            if len(group) > 1 and padded <= GROUP_WASTE * own + GROUP_SLACK and padded <= GROUP_AREA:
                members[-1] = group
            else:
                members.append([prompt])
        groups = [cls._group(group, lengths, starts, slots, firsts, device) for group in members if len(group) > 1]
        alone = [(slots[i], starts[i], lengths[i], firsts[i]) for group in members if len(group) == 1 for i in group]
        return cls(groups, alone)

    @staticmethod
    def _group(group: list[int], lengths: list[int], starts: list[int], slots: list[int], firsts: list[int],
               device) -> AttentionGroup:
        length = max(lengths[i] for i in group)
        columns = max(starts[i] + lengths[i] for i in group)
        place = torch.arange(length)
        real = place[None, :] < torch.tensor([lengths[i] for i in group])[:, None]  # [prompts, length]
        gather = torch.where(real, torch.tensor([firsts[i] for i in group])[:, None] + place, 0).flatten()
        places = real.flatten().nonzero()[:, 0]
        group_starts = torch.tensor([starts[i] for i in group])
        parts = [torch.tensor([slots[i] for i in group]), gather, places, gather[places], group_starts, real.flatten().long()]
        group_slots, gather, places, rows, group_starts, real = in_one_copy(parts, device)
        real = real.view(len(group), length).bool()
        column = torch.arange(columns, device=device)
        # A token sees its slot's columns up to its own; a padding place sees column 0 only (its output is dropped).
        sees = column <= (group_starts[:, None] + torch.arange(length, device=device))[:, :, None]
        sees = (sees & real[:, :, None]) | ((column == 0) & ~real[:, :, None])
        return AttentionGroup(group_slots, gather, places, rows, sees, length, columns)


@dataclass
class Rows:
    """Where each row of a forward pass belongs: its slot, its column there (its position in its
    sequence) and its rotary position. A prefill's prompts also have their slots (`prompt_slots`, on
    the device), their lengths, the rows of each prompt's last `conv_width` tokens with which of them
    exist (a shorter prompt has zeros before its first, as the model's convolution state does) and
    each prompt's last row. Its prompts are laid out in one of two ways:

    - packed back to back (`packed`): `bounds` says where each starts, then the end (on the CPU and on
      the device);
    - front-padded with zero embeddings to one length each (`padded`), as one batch of `sequences`
      rows: the DeltaNet layers keep a zero state through zero inputs, and attention masks the
      padding out (`sees`). Everything here is then computed on the device from the padding counts,
      so a captured CUDA graph serves any prompt lengths up to that length."""

    slots: torch.Tensor
    columns: torch.Tensor
    rope_positions: torch.Tensor
    places: torch.Tensor | None = None  # a prefill row's place in its prompt's rows, padding included
    lengths: list[int] | None = None
    prompt_slots: torch.Tensor | None = None
    tail_rows: torch.Tensor | None = None
    tail_exists: torch.Tensor | None = None
    last_rows: torch.Tensor | None = None
    bounds: torch.Tensor | None = None
    device_bounds: torch.Tensor | None = None
    sequences: int = 1
    sees: torch.Tensor | None = None
    attention: PackedAttention | None = None  # packed only

    @classmethod
    def packed(cls, lengths: list[int], first_slot: int, conv_width: int, device) -> "Rows":
        """A prefill's rows, moved to the device in one copy: a copy from pageable memory per layer
        would wait for the GPU each time."""
        bounds = torch.tensor([0, *itertools.accumulate(lengths)])
        columns = torch.cat([torch.arange(length) for length in lengths])
        prompt_slots = torch.arange(first_slot, first_slot + len(lengths))
        slots = prompt_slots.repeat_interleave(torch.tensor(lengths))
        tails = bounds[1:, None] - conv_width + torch.arange(conv_width)
        exists = tails >= bounds[:-1, None]
        parts = [columns, slots, prompt_slots, bounds, tails.clamp(min=0).flatten(), exists.flatten().long()]
        columns, slots, prompt_slots, device_bounds, tail_rows, tail_exists = in_one_copy(parts, device)
        shape = (len(lengths), conv_width)
        attention = PackedAttention.planned(lengths, [0] * len(lengths), list(range(first_slot, first_slot + len(lengths))), device)
        return cls(slots, columns, columns, columns, lengths, prompt_slots, tail_rows.view(shape),
                   tail_exists.view(shape).bool(), device_bounds[1:] - 1, bounds, device_bounds, attention=attention)

    @classmethod
    def padded(cls, pads: torch.Tensor, prompt_slots: torch.Tensor, length: int, conv_width: int) -> "Rows":
        """`pads[i]` zero rows, then prompt i's tokens, `length` rows in all, for slot prompt_slots[i].
        Prompt i's token j sits at column j; its padding rows write their (zero) keys at the columns
        after the prompt, which its decode steps overwrite before reading."""
        sequences, device = pads.shape[0], pads.device
        row = torch.arange(length, device=device)
        position = row - pads[:, None]  # [sequences, length], negative on padding
        column = position.remainder(length)
        # [sequences, rows, columns]: a token sees its prompt's columns up to its own; padding its own column.
        sees = (row <= position[:, :, None]) | (row == column[:, :, None])
        starts = torch.arange(sequences, device=device)[:, None] * length
        tails = starts + length - conv_width + torch.arange(conv_width, device=device)
        return cls(prompt_slots.repeat_interleave(length), column.flatten(), position.clamp(min=0).flatten(),
                   row.repeat(sequences), [length] * sequences, prompt_slots, tails, torch.ones_like(tails, dtype=torch.bool),
                   starts[:, 0] + length - 1, sequences=sequences, sees=sees)


@dataclass
class ContinuedRows:
    """A prefill of prompts that go on from what their slots hold (a conversation's earlier turns, kept by
    app.engine.conversations): prompt i's `lengths[i]` new tokens, packed back to back, after the
    `starts[i]` tokens of slot `slot_list[i]` (packed: `attention` plans their attention). Each new token's column
    and rotary position is its place in the whole conversation (plain token counts: prompts with canvas positions never go on this way).

    The DeltaNet convolution reads each prompt's kept inputs (the slot's convolution state, `width` rows)
    before its new ones: packed, `conv_*` lay that input out, block after block, and say where the new state's
    rows are (the last `width` of each block); padded, the kernels read the slots' states in place and need none."""

    slots: torch.Tensor
    columns: torch.Tensor
    rope_positions: torch.Tensor
    lengths: list[int]
    prompt_slots: torch.Tensor
    bounds: torch.Tensor
    device_bounds: torch.Tensor
    last_rows: torch.Tensor
    conv_state_rows: torch.Tensor | None
    conv_token_rows: torch.Tensor | None
    conv_places: torch.Tensor | None
    conv_tail_rows: torch.Tensor | None
    # Laid out for a captured graph instead (padded): `sequences` prompts of one length each, their tokens
    # first, then padding, which leaves every state as it is (`real` rows, masked where it would not), and
    # attention over each prompt's slot up to each row's column (app.model.text.prefill_attention.continued:
    # `sees` masks the columns PyTorch's version reads); everything computed on the device.
    sequences: int = 1
    real: torch.Tensor | None = None
    sees: torch.Tensor | None = None
    prompt_starts: torch.Tensor | None = None  # padded only: `starts` and `lengths` on the device
    prompt_lengths: torch.Tensor | None = None
    attention: PackedAttention | None = None  # packed only

    @classmethod
    def padded(cls, lengths: torch.Tensor, starts: torch.Tensor, prompt_slots: torch.Tensor, length: int,
               columns: int) -> "ContinuedRows":
        """Prompt i's `lengths[i]` new tokens after slot prompt_slots[i]'s `starts[i]`, then padding up to
        `length` rows; `sees` masks the slot's first `columns` columns (PyTorch's version of the attention
        reads them all; the kernel reads each row's own). Padding rows write their keys at the columns after
        the prompt, which its decode steps overwrite before reading."""
        sequences, device = lengths.shape[0], lengths.device
        place = torch.arange(length, device=device)
        column = (starts[:, None] + place).flatten()
        sees = torch.arange(columns, device=device)[None, None, :] <= (starts[:, None] + place)[:, :, None]
        return cls(prompt_slots.repeat_interleave(length), column, column, [length] * sequences, prompt_slots, None, None,
                   torch.arange(sequences, device=device) * length + lengths - 1, None, None, None, None, sequences,
                   (place < lengths[:, None]).flatten(), sees, starts, lengths)

    @classmethod
    def packed(cls, lengths: list[int], starts: list[int], slot_list: list[int], width: int, device) -> "ContinuedRows":
        bounds = torch.tensor([0, *itertools.accumulate(lengths)])
        columns = torch.cat([start + torch.arange(length) for start, length in zip(starts, lengths)])
        prompt_slots = torch.tensor(slot_list)
        slots = prompt_slots.repeat_interleave(torch.tensor(lengths))
        blocks = torch.tensor([0, *itertools.accumulate(width + length for length in lengths)])
        state_rows = (blocks[:-1, None] + torch.arange(width)).flatten()
        token_rows = torch.cat([block + width + torch.arange(length) for block, length in zip(blocks.tolist(), lengths)])
        places = torch.cat([torch.arange(width + length) for length in lengths])
        tail_rows = blocks[1:, None] - width + torch.arange(width)
        parts = [columns, slots, prompt_slots, bounds, state_rows, token_rows, places, tail_rows.flatten()]
        columns, slots, prompt_slots, device_bounds, state_rows, token_rows, places, tail_rows = in_one_copy(parts, device)
        return cls(slots, columns, columns, lengths, prompt_slots, bounds, device_bounds,
                   device_bounds[1:] - 1, state_rows, token_rows, places, tail_rows.view(len(lengths), width),
                   attention=PackedAttention.planned(lengths, starts, slot_list, device))
