"""Next-token choice per row: greedy, minimum length, repetition penalty, temperature, top-k, top-p."""

import pytest
import torch

from app.model.sampling import RowSettings, next_tokens
from app.model.transfers import TokensOnTheirWay

GREEDY = RowSettings(do_sample=False, temperature=1.0, top_k=0, top_p=1.0, repetition_penalty=1.0)
END = torch.tensor([3, 7])


def sample(row: RowSettings, logits: torch.Tensor, draws: int = 4000) -> torch.Tensor:
    """`draws` tokens drawn for one row's logits (the row repeated down a batch)."""
    batch = logits.repeat(draws, 1)
    return next_tokens(batch, [row] * draws, [None] * draws, [False] * draws, END)


def frequencies(tokens: torch.Tensor, vocab: int) -> torch.Tensor:
    return torch.bincount(tokens, minlength=vocab).float() / tokens.numel()


def test_greedy_takes_the_argmax_and_a_barred_row_never_ends():
    torch.manual_seed(0)
    logits = torch.randn(3, 20)
    logits[1, 3] = logits[2, 7] = 100.0  # rows 1 and 2 would end now
    chosen = next_tokens(logits, [GREEDY] * 3, [None] * 3, [False, True, False], END)
    allowed = logits[1].clone()
    allowed[END] = float("-inf")
    assert chosen[0] == logits[0].argmax() and chosen[1] == allowed.argmax() and chosen[2] == 7
    assert TokensOnTheirWay(chosen).tolist() == [logits[0].argmax().item(), allowed.argmax().item(), 7]


def test_greedy_rows_choose_in_the_logits_own_dtype_as_in_float32():
    """bf16 logits are not copied to float32 for greedy and barred rows; the choice is the same."""
    torch.manual_seed(0)
    logits = torch.randn(6, 5000).bfloat16()
    logits[2, 3] = logits[4, 7] = 100.0  # would end now, but barred
    barred = [False, False, True, False, True, False]
    here = next_tokens(logits.clone(), [GREEDY] * 6, [None] * 6, barred, END)
    assert torch.equal(here, next_tokens(logits.float(), [GREEDY] * 6, [None] * 6, barred, END))
    assert here[2] not in END and here[4] not in END


def test_a_repetition_penalty_turns_greedy_away_from_seen_tokens():
    logits = torch.tensor([[0.0, 5.0, 4.0, 1.0]])
    penalised = RowSettings(do_sample=False, temperature=1.0, top_k=0, top_p=1.0, repetition_penalty=2.0)
    assert next_tokens(logits, [penalised], [torch.tensor([1])], [False], END).item() == 2  # 5 / 2 < 4
    assert next_tokens(logits, [penalised], [torch.tensor([2])], [False], END).item() == 1


def test_plain_sampling_follows_the_softmax_at_its_temperature():
    torch.manual_seed(1)
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0]])
    for temperature in (1.0, 0.5):
        row = RowSettings(do_sample=True, temperature=temperature, top_k=0, top_p=1.0, repetition_penalty=1.0)
        expected = (logits[0] / temperature).softmax(-1)
        assert torch.allclose(frequencies(sample(row, logits, 20000), 4), expected, atol=0.015)


def test_top_k_and_top_p_draw_only_from_their_tokens_in_proportion():
    torch.manual_seed(2)
    logits = torch.tensor([[2.0, 0.5, 3.0, -1.0, 1.0, 2.5, 0.0, -2.0]])
    probabilities = logits[0].softmax(-1)
    top3 = [2, 5, 0]  # the three largest logits
    row = RowSettings(do_sample=True, temperature=1.0, top_k=3, top_p=1.0, repetition_penalty=1.0)
    seen = frequencies(sample(row, logits, 20000), 8)
    assert set(seen.nonzero().flatten().tolist()) == set(top3)
    assert torch.allclose(seen[top3], probabilities[top3] / probabilities[top3].sum(), atol=0.015)
    # Nucleus: tokens are kept while the mass before them is at most top_p (here the two largest).
    nucleus = RowSettings(do_sample=True, temperature=1.0, top_k=0, top_p=0.6, repetition_penalty=1.0)
    assert set(sample(nucleus, logits).unique().tolist()) == {2, 5}
    both = RowSettings(do_sample=True, temperature=1.0, top_k=3, top_p=0.6, repetition_penalty=1.0)
    assert set(sample(both, logits).unique().tolist()) == {2, 5}


def test_rows_of_a_batch_keep_their_own_settings():
    torch.manual_seed(3)
    logits = torch.tensor([[2.0, 0.5, 3.0, -1.0, 1.0, 2.5, 0.0, -2.0]]).repeat(4, 1)
    rows = [GREEDY, RowSettings(True, 1.0, 1, 1.0, 1.0), RowSettings(True, 1.0, 0, 0.01, 1.0),
            RowSettings(True, 1.0, 2, 1.0, 1.0)]
    for _ in range(50):
        chosen = next_tokens(logits, rows, [None] * 4, [False] * 4, END).tolist()
        assert chosen[:3] == [2, 2, 2] and chosen[3] in (2, 5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_on_a_gpu_the_choice_never_waits_for_the_gpu():
    # The scheduler chooses right after launching a decode step: a call that synchronized would wait for it.
    torch.manual_seed(3)
    logits = torch.randn(6, 1000, device="cuda")
    penalised = RowSettings(do_sample=False, temperature=1.0, top_k=0, top_p=1.0, repetition_penalty=1.3)
    rows = [GREEDY, penalised,
            RowSettings(do_sample=True, temperature=0.7, top_k=0, top_p=1.0, repetition_penalty=1.0),
            RowSettings(do_sample=True, temperature=1.0, top_k=5, top_p=1.0, repetition_penalty=1.0),
            RowSettings(do_sample=True, temperature=1.0, top_k=0, top_p=0.8, repetition_penalty=1.2),
            GREEDY]
    seen = [None, torch.tensor([1, 2, 2], device="cuda"), None, None, torch.tensor([4], device="cuda"), None]
    end = END.cuda()
    expected = next_tokens(logits.clone(), rows[:2], seen[:2], [True, False], end)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with pytest.raises(RuntimeError, match="synchronizing"):  # the mode is on: a wait would fail
            logits.sum().item()
        greedy = next_tokens(logits.clone(), rows[:2], seen[:2], [True, False], end)
        mixed = next_tokens(logits.clone(), rows, seen, [True, False, True, False, False, True], end)
        on_their_way = TokensOnTheirWay(mixed)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert torch.equal(greedy, expected)
    tokens = on_their_way.tolist()
    assert len(tokens) == 6 and not {tokens[0], tokens[5]} & set(END.tolist())


def test_no_temperature_overflows_and_a_row_that_cannot_be_sampled_fails_alone():
    """A tiny temperature overflowed every logit but the largest to infinity, and one row's NaN made
    torch.multinomial fail the whole batch. Now the tiny temperature samples the argmax, and a row whose
    logits are not finite is -1 (it fails alone) while the rows beside it keep their own choices."""
    torch.manual_seed(4)
    logits = torch.randn(5, 50) * 30
    logits[3] = float("nan")
    logits[4, 10] = float("inf")
    rows = [RowSettings(True, 1e-45, 0, 1.0, 1.0), RowSettings(True, 1e-45, 5, 0.5, 1.0), GREEDY,
            RowSettings(True, 0.7, 0, 1.0, 1.0), RowSettings(True, 0.7, 3, 1.0, 1.0)]
    for _ in range(20):
        chosen = next_tokens(logits.clone(), rows, [None] * 5, [False] * 5, END).tolist()
        assert chosen[:3] == logits[:3].argmax(-1).tolist()
        assert chosen[3] == -1 and chosen[4] == -1
