"""Next-token choice for a batch whose rows each have their own decoding settings.

The order follows transformers' generate(): repetition penalty, minimum length (end tokens barred),
then greedy argmax, or temperature, top-k and top-p before drawing a sample.
"""

from dataclasses import dataclass

import torch

from app.engine.transfers import on_device


@dataclass(frozen=True)
class RowSettings:
    do_sample: bool
    temperature: float
    top_k: int
    top_p: float
    repetition_penalty: float


def next_tokens(logits: torch.Tensor, rows: list[RowSettings], seen: list[torch.Tensor | None],
                barred: list[bool], end_token_ids: torch.Tensor) -> torch.Tensor:
    """One token per row of `logits` [n, vocab].

    seen[i]: token ids row i has seen (prompt and reply), needed only when it has a repetition penalty;
    barred[i]: row i is below its minimum length, so it may not end yet.
    """
    logits = logits.float()
    for row, (settings, tokens) in enumerate(zip(rows, seen)):
        if settings.repetition_penalty != 1.0 and tokens is not None:
            picked = logits[row, tokens]
            logits[row, tokens] = torch.where(picked < 0, picked * settings.repetition_penalty,
                                              picked / settings.repetition_penalty)
    barred_rows = [row for row, is_barred in enumerate(barred) if is_barred]
    if len(barred_rows) == len(barred) and end_token_ids.numel():
        logits[:, end_token_ids] = float("-inf")
    elif barred_rows and end_token_ids.numel():
        logits[on_device(barred_rows, torch.long, logits.device)[:, None], end_token_ids[None, :]] = float("-inf")
    chosen = logits.argmax(dim=-1)
    sampled = [row for row, settings in enumerate(rows) if settings.do_sample]
    if sampled:
        index = on_device(sampled, torch.long, logits.device)
        chosen[index] = _sample(logits[index], [rows[row] for row in sampled])
    return chosen


def _sample(logits: torch.Tensor, rows: list[RowSettings]) -> torch.Tensor:
    """Draw from each row's distribution after temperature, top-k and top-p.

    Only top-k and top-p need the vocabulary in order, and ordering 248k logits per row per step is
    what sampling cost (35 ms a row on a CPU core, 70x a greedy step's choice): plain sampling draws
    from the softmax directly, and when every row has a top-k only the largest k are ordered.
    """
    device = logits.device
    temperature = on_device([row.temperature for row in rows], torch.float32, device)[:, None]
    logits = logits / temperature
    if all(row.top_k == 0 and row.top_p >= 1.0 for row in rows):
        return torch.multinomial(logits.softmax(dim=-1), num_samples=1)[:, 0]
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
    picks = torch.multinomial(ordered.softmax(dim=-1), num_samples=1)[:, 0]
    return order.gather(-1, picks[:, None])[:, 0]
