"""The wave policy (app.engine.waves): which waiting requests join the next prefill."""

import pytest

from app import tuning
from app.engine.waves import padded_length, wave_size


def test_prompts_are_padded_to_the_length_multiple():
    multiple = tuning.PREFILL_LENGTH_MULTIPLE
    assert [padded_length(n) for n in (1, multiple, multiple + 1)] == [multiple, multiple, 2 * multiple]


@pytest.mark.parametrize("prompts, free_slots, budget, expected", [
    ([], 8, 16384, 0),  # nobody waits
    ([100] * 5, 0, 16384, 0),  # no free slot
    ([100] * 5, 8, 16384, 4),  # five fit: a wave of 2^k, the fifth waits for the next
    ([100] * 8, 8, 16384, 8),
    ([100] * 20, 8, 16384, 8),  # the free slots bound it
    ([100] * 20, 3, 16384, 2),
    ([20000, 100, 100], 8, 16384, 1),  # a prompt over the budget is prefilled alone
    ([100, 20000, 100], 8, 16384, 1),  # padded to the longest, two would be 2 x 20,032 tokens
    ([1000] * 20, 32, 16384, 16),  # 16 x 1,024 padded tokens fill the budget exactly
    ([1000] * 20, 32, 16383, 8),  # one token less: 15 fit, a wave of 8
])
def test_a_wave_takes_from_the_front_what_the_slots_and_the_budget_hold_in_a_power_of_two(
        prompts, free_slots, budget, expected):
    assert wave_size(prompts, free_slots, budget) == expected


def test_the_longest_prompt_so_far_sets_the_padding_of_the_whole_wave():
    """Short prompts behind a long one are padded to it: fewer of them fit."""
    long = 4 * tuning.PREFILL_LENGTH_MULTIPLE
    short = 1
    assert wave_size([long] + [short] * 10, 32, 8 * long) == 8
    assert wave_size([short] * 10 + [long], 32, 8 * long) == 8
    assert wave_size([short] * 10, 32, 8 * long) == 8  # 10 fit, rounded down to 8


def test_the_line_is_read_lazily_and_only_as_far_as_the_wave_goes():
    read = []

    def prompts():
        for n in range(1000):
            read.append(n)
            yield 100

    assert wave_size(prompts(), 4, 16384) == 4
    assert len(read) == 4
