"""Visual-token counts against the real MiniCPM-V 4.6 processor, and the multi-image budget planner."""

import pytest
from PIL import Image
from transformers.models.minicpmv4_6 import MiniCPMV4_6ImageProcessor

from app.errors import UserError
from app.media.budget import image_token_count, plan_slices


@pytest.fixture(scope="module")
def image_processor():
    return MiniCPMV4_6ImageProcessor()  # the real defaults: scale_resolution 448, max_slice_nums 9, patch 14


def processor_count(manager, size, max_slice_nums=9, downsample_mode="16x") -> int:
    """Visual tokens the checkpoint's processor really emits for one image of `size`."""
    processor = manager.processor
    inputs = processor(text=[processor.tokenizer.image_token], images=[[Image.new("RGB", size)]],
                       images_kwargs={"max_slice_nums": max_slice_nums, "downsample_mode": downsample_mode})
    return int((inputs["input_ids"] == processor.tokenizer.image_token_id).sum())


def test_a_1344_square_image_costs_640_tokens(manager):
    assert processor_count(manager, (1344, 1344)) == 640


@pytest.mark.parametrize("slices, tokens", [(1, 64), (2, 196), (3, 196), (4, 320), (5, 320), (6, 484), (7, 484), (8, 592), (9, 640)])
def test_slice_counts_match_the_processor(manager, image_processor, slices, tokens):
    assert image_token_count(image_processor, 1344, 1344, slices, "16x") == tokens
    assert processor_count(manager, (1344, 1344), slices) == tokens


@pytest.mark.parametrize("width, height, mode, tokens", [
    (1920, 1080, "16x", 578), (4000, 1000, "16x", 592), (448, 448, "16x", 64), (448, 448, "4x", 256),
    (1344, 1344, "4x", 2560), (640, 480, "16x", None), (300, 2000, "16x", None), (1, 1, "16x", None),
])
def test_planner_counts_equal_processor_counts(manager, image_processor, width, height, mode, tokens):
    counted = processor_count(manager, (width, height), 9, mode)
    assert image_token_count(image_processor, height, width, 9, mode) == counted
    if tokens is not None:
        assert counted == tokens


def test_budget_fits_without_lowering(image_processor):
    plan = plan_slices(image_processor, [(1344, 1344)] * 4, 9, "16x", 2560)
    assert plan.max_slice_nums == 9 and plan.total_tokens == 2560 and not plan.lowered and plan.notice() is None


def test_budget_lowers_slices_for_every_image_until_it_fits(image_processor):
    plan = plan_slices(image_processor, [(1344, 1344)] * 5, 9, "16x", 2560)
    assert plan.max_slice_nums == 7
    assert plan.tokens_per_image == (484,) * 5 and plan.total_tokens == 2420
    assert "lowered from 9 to 7" in plan.notice()


def test_budget_leaves_small_images_at_their_cost(image_processor):
    plan = plan_slices(image_processor, [(1344, 1344), (1344, 1344), (448, 448), (1344, 1344), (1344, 1344)], 9, "16x", 2560)
    assert plan.tokens_per_image[2] == 64
    assert plan.total_tokens <= 2560


def test_budget_too_small_even_at_one_slice(image_processor):
    with pytest.raises(UserError, match="visual budget"):
        plan_slices(image_processor, [(1344, 1344)] * 11, 9, "16x", 640)
