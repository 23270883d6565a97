"""The vision tower's inputs and grouped attention."""

import torch
from torch.nn.functional import scaled_dot_product_attention

from app.engine import vision_tower
from app.engine.inputs import prepare_inputs
from app.engine.settings import GenerationSettings
from tests.conftest import make_image


def per_slice_attention(query, key, value, lengths, scale):
    outputs, start = [], 0
    for length in lengths:
        window = slice(start, start + length)
        outputs.append(scaled_dot_product_attention(query[:, :, window], key[:, :, window], value[:, :, window],
                                                    scale=scale).transpose(1, 2))
        start += length
    return torch.cat(outputs, dim=1)


def test_grouped_attention_equals_one_call_per_slice(monkeypatch):
    torch.manual_seed(0)
    heads, dim = 4, 8
    # Runs of equal slices, a lone slice, and a run longer than one call may hold (split in three).
    monkeypatch.setattr(vision_tower, "MAX_GRID_ROWS", 3 * heads)
    for lengths in ([16, 16, 16], [16, 16, 9, 9, 16], [5], [4] * 8):
        tokens = sum(lengths)
        # As the model hands them over: [1, heads, tokens, dim] views of [1, tokens, heads, dim] projections.
        query, key, value = (torch.randn(1, tokens, heads, dim).transpose(1, 2) for _ in range(3))
        bounds = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
        grouped, _ = vision_tower.grouped_varlen_attention(None, query, key, value, scaling=0.3, cu_seq_lens_q=bounds)
        assert grouped.shape == (1, tokens, heads, dim)
        torch.testing.assert_close(grouped, per_slice_attention(query, key, value, lengths, 0.3), rtol=0, atol=1e-6)


def test_pixels_come_prepared_in_the_towers_dtype(manager, tmp_path):
    messages = [{"role": "user", "content": [{"type": "image", "path": make_image(tmp_path, "p.png")},
                                             {"type": "text", "text": "What is this?"}]}]
    settings = GenerationSettings(max_new_tokens=8)
    as_processed = prepare_inputs(manager.processor, messages, settings, 4096)
    as_sent = prepare_inputs(manager.processor, messages, settings, 4096, pixel_dtype=torch.bfloat16)
    assert as_processed.tensors["pixel_values"].dtype == torch.float32
    assert as_sent.tensors["pixel_values"].dtype == torch.bfloat16
    # What the model's own cast would have made of them.
    assert torch.equal(as_sent.tensors["pixel_values"], as_processed.tensors["pixel_values"].to(torch.bfloat16))
