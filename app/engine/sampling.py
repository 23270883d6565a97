"""Next-token choice for a batch whose rows each have their own decoding settings.

The order follows transformers' generate(): repetition penalty, minimum length (end tokens barred),
then greedy argmax, or temperature, top-k and top-p before drawing a sample.
"""

from dataclasses import dataclass

import torch


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
    if barred_rows and end_token_ids.numel():
        logits[torch.tensor(barred_rows, device=logits.device)[:, None], end_token_ids[None, :]] = float("-inf")
    chosen = logits.argmax(dim=-1)
    sampled = [row for row, settings in enumerate(rows) if settings.do_sample]
    if sampled:
        index = torch.tensor(sampled, device=logits.device)
        chosen[index] = _sample(logits[index], [rows[row] for row in sampled])
    return chosen


class TokensOnTheirWay:
    """Chosen tokens on their way to the host: the copy starts at once, and tolist() waits for it alone,
    not for what the GPU was given since.

    From a GPU, through pinned memory and a CUDA event rather than `.tolist()`: its synchronous copy to
    pageable memory, while a decode step waited behind a wave of images, also held up other threads' CUDA
    calls. On an H200, staging a request's pixels took 25-28 ms instead of 1.4, and preparing a request
    132-134 ms instead of 74 (benchmarks/side_by_side.py)."""

    def __init__(self, chosen: torch.Tensor):
        self._copied = None
        if chosen.is_cuda:
            self._host = torch.empty(chosen.shape, dtype=chosen.dtype, pin_memory=True)
            self._host.copy_(chosen, non_blocking=True)
            self._copied = torch.cuda.Event()
            self._copied.record(torch.cuda.current_stream(chosen.device))
        else:
            self._host = chosen

    def tolist(self) -> list[int]:
        if self._copied is not None:
            self._copied.synchronize()
        return self._host.tolist()


def _sample(logits: torch.Tensor, rows: list[RowSettings]) -> torch.Tensor:
    """Draw from each row's distribution after temperature, top-k and top-p.

    Only top-k and top-p need the vocabulary in order, and ordering 248k logits per row per step is
    what sampling cost (35 ms a row on a CPU core, 70x a greedy step's choice): plain sampling draws
    from the softmax directly, and when every row has a top-k only the largest k are ordered.
    """
    device = logits.device
    temperature = torch.tensor([row.temperature for row in rows], device=device)[:, None]
    logits = logits / temperature
    if all(row.top_k == 0 and row.top_p >= 1.0 for row in rows):
        return torch.multinomial(logits.softmax(dim=-1), num_samples=1)[:, 0]
    if all(row.top_k for row in rows):
        ordered, order = logits.topk(max(row.top_k for row in rows), dim=-1)
    else:
        ordered, order = logits.sort(dim=-1, descending=True)
    rank = torch.arange(ordered.shape[-1], device=device)[None, :]
    top_k = torch.tensor([row.top_k or logits.shape[-1] for row in rows], device=device)[:, None]
    ordered = ordered.masked_fill(rank >= top_k, float("-inf"))
    top_p = torch.tensor([row.top_p for row in rows], device=device)[:, None]
    probabilities = ordered.softmax(dim=-1)
    mass_before = probabilities.cumsum(dim=-1) - probabilities
    ordered = ordered.masked_fill((mass_before > top_p) & (rank > 0), float("-inf"))
    picks = torch.multinomial(ordered.softmax(dim=-1), num_samples=1)[:, 0]
    return order.gather(-1, picks[:, None])[:, 0]
