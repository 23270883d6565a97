"""Next-token choice for a batch whose rows each have their own decoding settings.

The order follows transformers' generate(): repetition penalty, minimum length (end tokens barred),
then greedy argmax, or temperature, top-k and top-p before drawing a sample. A row with a generator of its
own (a reply with a seed) draws with it, so that its draws do not depend on the batch it is in.
"""

from dataclasses import dataclass

import torch

from app.engine.settings import RowSettings
from app.model.transfers import TokensOnTheirWay, on_device


@dataclass(frozen=True)
class Choice:
    """A batch's chosen tokens: on the device as the next step's input (usable_as_input), on their way
    to the host, and each row's seen tokens with its choice appended (None where not kept)."""
    as_input: torch.Tensor
    read_back: TokensOnTheirWay
    seen: list


def choose(logits: torch.Tensor, rows: list[RowSettings], seen: list[torch.Tensor | None], barred: list[bool],
           end_token_ids: torch.Tensor, generators: list | None = None) -> Choice:
    """next_tokens, with what the scheduler needs of them; nothing here waits for the GPU."""
    chosen = next_tokens(logits, rows, seen, barred, end_token_ids, generators)
    as_input = usable_as_input(chosen, rows)
    # On the device, so that the next step's choice need not wait.
    seen = [None if tokens is None else torch.cat([tokens, as_input[row:row + 1]]) for row, tokens in enumerate(seen)]
    return Choice(as_input, TokensOnTheirWay(chosen), seen)


def next_tokens(logits: torch.Tensor, rows: list[RowSettings], seen: list[torch.Tensor | None],
                barred: list[bool], end_token_ids: torch.Tensor, generators: list | None = None) -> torch.Tensor:
    """One token per row of `logits` [n, vocab]; -1 for a sampled row that could not be sampled (_sample).

    seen[i]: token ids row i has seen (prompt and reply), needed only when it has a repetition penalty;
    barred[i]: row i is below its minimum length, so it may not end yet; generators[i] (None: the global
    generator): what a sampled row i draws with.

    On a GPU nothing here waits for it (tests/test_sampling.py checks in torch's sync debug mode): the
    scheduler calls this right after launching a decode step. Hence gathers and scatters rather than
    assignments through an index, which synchronize when the value is a Python number.
    """
    if not logits.is_floating_point() or any(settings.do_sample or settings.repetition_penalty != 1.0 for settings in rows):
        logits = logits.float()  # penalties and draws in float32, as generate() makes them
    # Otherwise the argmax, with the barred ends at -inf, is the same in the logits' own floating dtype
    # (bf16 to float32 is exact), and a float32 copy of a whole batch's logits was most of a greedy
    # choice's time.
    for row, (settings, tokens) in enumerate(zip(rows, seen)):
        if settings.repetition_penalty != 1.0 and tokens is not None:
            picked = logits[row].gather(0, tokens)
            logits[row].scatter_(0, tokens, torch.where(picked < 0, picked * settings.repetition_penalty,
                                                        picked / settings.repetition_penalty))
    if any(barred) and end_token_ids.numel():
        ends = end_token_ids.expand(len(barred), -1)
        rows_barred = on_device(barred, torch.bool, logits.device)[:, None]
        logits.scatter_(1, ends, logits.gather(1, ends).masked_fill(rows_barred, float("-inf")))
    chosen = logits.argmax(dim=-1)
    sampled = [row for row, settings in enumerate(rows) if settings.do_sample]
    if sampled:
        index = on_device(sampled, torch.long, logits.device)
        own = [generators[row] for row in sampled] if generators else [None] * len(sampled)
        chosen.index_copy_(0, index, _sample(logits.index_select(0, index), [rows[row] for row in sampled], own))
    return chosen


def usable_as_input(chosen: torch.Tensor, rows: list[RowSettings]) -> torch.Tensor:
    """`chosen` as the next step's input: a row that could not be sampled (-1) gets token 0 there, and
    leaves the batch once its -1 is read (only sampled rows can hold one)."""
    return chosen.clamp(min=0) if any(settings.do_sample for settings in rows) else chosen


def _sample(logits: torch.Tensor, rows: list[RowSettings], generators: list) -> torch.Tensor:
    """Draw from each row's distribution after temperature, top-k and top-p; -1 for a row whose
    probabilities are not finite numbers (the model's logits were not), which then fails alone: its
    draw is made from a stand-in distribution, as torch.multinomial fails the whole batch on one bad row.

    The largest logit of each row is taken off before the temperature divides them: the largest is
    then 0 whatever the temperature, and no small temperature overflows the others to infinity.

    Only top-k and top-p need the vocabulary in order, and ordering 248k logits per row per step is
    what sampling cost (35 ms a row on a CPU core, 70x a greedy step's choice): plain sampling draws
    from the softmax directly, and when every row has a top-k only the largest k are ordered.
    """
    device = logits.device
    temperature = on_device([row.temperature for row in rows], torch.float32, device)[:, None]
    logits = (logits - logits.amax(dim=-1, keepdim=True)) / temperature
    if all(row.top_k == 0 and row.top_p >= 1.0 for row in rows):
        return _draw(logits.softmax(dim=-1), generators)
    if all(row.top_k for row in rows):
        ordered, order = logits.topk(max(row.top_k for row in rows), dim=-1)
    else:
        ordered, order = logits.sort(dim=-1, descending=True)
    rank = torch.arange(ordered.shape[-1], device=device)[None, :]
    top_k = on_device([row.top_k or logits.shape[-1] for row in rows], torch.long, device)[:, None]
    ordered = ordered.masked_fill(rank >= top_k, float("-inf"))
    top_p = on_device([row.top_p for row in rows], torch.float32, device)[:, None]
    probabilities = ordered.softmax(dim=-1)
    mass_before = probabilities.cumsum(dim=-1) - probabilities
    ordered = ordered.masked_fill((mass_before > top_p) & (rank > 0), float("-inf"))
    probabilities = ordered.softmax(dim=-1)
    picks = _draw(probabilities, [None] * len(rows))
    picks = torch.where(picks < 0, picks, order.gather(-1, picks.clamp(min=0)[:, None])[:, 0])
    seeded = [row for row, generator in enumerate(generators) if generator is not None]
    if seeded:  # drawn in the vocabulary's order: how far the batch's rows were ordered must not matter
        index = on_device(seeded, torch.long, device)
        in_vocabulary = torch.zeros((len(seeded), logits.shape[-1]), device=device).scatter_(
            1, order.index_select(0, index), probabilities.index_select(0, index))
        picks = picks.index_copy(0, index, _draw(in_vocabulary, [generators[row] for row in seeded]))
    return picks


def _draw(probabilities: torch.Tensor, generators: list) -> torch.Tensor:
    """One draw a row; -1 for a row that holds anything but finite numbers. A row with a generator of its own
    draws with it, as vLLM's sampler does: the token whose probability over its own exponential noise is the
    largest (a draw from the distribution), with noise for every token of the row whatever the batch holds,
    so that the same seed makes the same draws in any batch."""
    finite = probabilities.isfinite().all(dim=-1)
    probabilities = torch.where(finite[:, None], probabilities, 1.0)
    picks = torch.multinomial(probabilities, num_samples=1)[:, 0]
    seeded = [row for row, generator in enumerate(generators) if generator is not None]
    if seeded:
        own = torch.stack([(probabilities[row] / torch.empty_like(probabilities[row]).exponential_(generator=generators[row]))
                           .argmax() for row in seeded])
        picks = picks.index_copy(0, on_device(seeded, torch.long, probabilities.device), own)
    return torch.where(finite, picks, -1)
