"""A preparing worker's tensors on their way back to the engine's process: small ones by value, large ones
in the request's pixel slot while they fit, the rest as torch sends tensors."""

import numpy
import torch

from app.engine.preparers import BY_VALUE_BYTES, InSlot, _for_the_way_back, _from_the_way_back


def test_tensors_come_back_equal_small_by_value_and_large_in_the_slot_while_they_fit():
    slot = torch.zeros(3 * BY_VALUE_BYTES, dtype=torch.uint8)
    pixels = torch.randint(0, 255, (1, 3, 14, BY_VALUE_BYTES // 40), dtype=torch.uint8)
    frames = torch.randn(1, 3, 14, BY_VALUE_BYTES // 80 + 7).to(torch.bfloat16)  # odd size: the next one is aligned
    tensors = {"input_ids": torch.arange(696)[None], "pixel_values": pixels, "pixel_values_videos": frames,
               "more": torch.ones(BY_VALUE_BYTES, dtype=torch.uint8), "note": "kept as it is"}
    sent = _for_the_way_back(tensors, slot)
    assert isinstance(sent["input_ids"], numpy.ndarray) and sent["note"] == "kept as it is"
    assert isinstance(sent["pixel_values"], InSlot) and isinstance(sent["pixel_values_videos"], InSlot)
    assert sent["pixel_values_videos"].offset % 64 == 0
    assert isinstance(sent["more"], torch.Tensor)  # no room left in the slot
    back = _from_the_way_back(sent, slot)
    slot.zero_()  # the slot is free again: what came back is a copy
    for key, value in tensors.items():
        assert torch.equal(back[key], value) if isinstance(value, torch.Tensor) else back[key] == value, key
    assert back["pixel_values_videos"].dtype == torch.bfloat16


def test_without_a_slot_large_tensors_go_as_torch_sends_them():
    pixels = torch.randint(0, 255, (BY_VALUE_BYTES + 1,), dtype=torch.uint8)
    sent = _for_the_way_back({"pixel_values": pixels}, None)
    assert sent["pixel_values"] is pixels and _from_the_way_back(sent, None)["pixel_values"] is pixels
