"""The wave policy: which waiting requests join the next prefill. Pure functions, no state, no GPU."""

from collections.abc import Iterable

from app import tuning


def padded_length(tokens: int) -> int:
    """Row length of a prefill wave whose longest prompt has `tokens` tokens (see PREFILL_LENGTH_MULTIPLE)."""
    multiple = tuning.PREFILL_LENGTH_MULTIPLE
    return -(-tokens // multiple) * multiple


def wave_size(prompt_tokens: Iterable[int], free_slots: int, token_budget: int) -> int:
    """How many requests from the front of the line (their prompts' token counts, in line order) join the
    next prefill: as many as the free slots hold while the wave, each prompt padded to its longest, fits
    `token_budget` (the first always joins: a prompt longer than the budget is prefilled alone), then
    rounded down to a power of 2, so that prefill shapes stay few (see PREFILL_LENGTH_MULTIPLE)."""
    count, longest = 0, 0
    for tokens in prompt_tokens if free_slots > 0 else ():
        wave_longest = max(longest, tokens)
        if count and (count + 1) * padded_length(wave_longest) > token_budget:
            break
        count, longest = count + 1, wave_longest
        if count == free_slots:
            break
    return 1 << (count.bit_length() - 1) if count else 0
