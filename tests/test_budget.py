"""Visual-token counts against the real MiniCPM-V 4.6 processor, and the multi-image budget planner."""

import pytest
from PIL import Image
from transformers import AutoProcessor
from transformers.models.minicpmv4_6 import MiniCPMV4_6ImageProcessor

from app import limits
from app.engine.inputs import prepare_inputs
from app.errors import UserError
from app.media.budget import image_token_count, plan_slices
from app.model.checkpoint.random_checkpoint import ensure_tiny_checkpoint
from tests.conftest import make_image


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


def test_4_7s_16_pixel_patches_make_a_view_49_tokens():
    """The sidebar's figures for MiniCPM-V 4.7 (its image processor is 4.6's, with the tower's 16-px patches)."""
    processor = MiniCPMV4_6ImageProcessor(patch_size=16)
    assert image_token_count(processor, 448, 448, 9, "16x") == 49
    assert image_token_count(processor, 1344, 1344, 9, "16x") == 490


def image_question(*paths) -> list[dict]:
    return [{"role": "user", "content": [*({"type": "image", "path": path} for path in paths),
                                          {"type": "text", "text": "What is this?"}]}]


@pytest.mark.parametrize("size, slices, mode", [
    ((1344, 1344), 9, "16x"), ((1920, 1080), 9, "16x"), ((4000, 1000), 4, "4x"), ((300, 2000), 36, "16x"),
    ((448, 448), 9, "16x"), ((640, 480), 2, "16x"), ((4000, 3000), 36, "4x"),
], ids=str)
def test_the_plan_is_the_cut_the_processor_makes(manager, tmp_path, size, slices, mode):
    """What the UI draws before a question is sent (manager.plan_images) is the processor's own grid, source
    view and slice sizes, and its tokens are those prepare_inputs counts in the prompt."""
    path = make_image(tmp_path, "a.png", size)
    settings = manager.default_settings().with_overrides({"max_slice_nums": slices, "downsample_mode": mode,
                                                          "visual_token_budget": limits.MAX_VISUAL_TOKEN_BUDGET})
    slicing = manager.plan_images([path], settings).images[0]
    processor = AutoProcessor.from_pretrained(ensure_tiny_checkpoint())  # as transformers ships it
    theirs = processor.image_processor([Image.open(path).convert("RGB")], max_slice_nums=slices, downsample_mode=mode)
    patch = processor.image_processor.patch_size
    views = [tuple(int(n) * patch for n in row) for row in theirs["target_sizes"]]
    assert slicing.size == (size[1], size[0]) and views[0] == slicing.source
    if slicing.grid is None:
        assert list(theirs["grids"][0]) == [0, 0] and len(views) == 1
    else:
        assert tuple(theirs["grids"][0]) == slicing.grid and views[1:] == [slicing.slice_size] * slicing.slice_count
    prepared = prepare_inputs(manager.processor, image_question(path), settings, 32768)
    assert prepared.image_tokens == [slicing.tokens]


def test_a_lowered_plan_counts_as_prepare_inputs_counts(manager, tmp_path):
    paths = [make_image(tmp_path, f"{i}.png", size) for i, size in enumerate([(1344, 1344)] * 4 + [(1920, 1080), (448, 448)])]
    settings = manager.default_settings()
    plan = manager.plan_images(paths, settings)
    assert plan.lowered and plan.tokens_per_image[-1] == 64
    assert prepare_inputs(manager.processor, image_question(*paths), settings, 32768).image_tokens == list(plan.tokens_per_image)


def test_a_photo_turned_by_its_exif_is_planned_upright(manager, tmp_path):
    """A phone's photo stored sideways: the plan (from the header alone) sees it as the model does, upright."""
    path = str(tmp_path / "turned.jpg")
    image = Image.new("RGB", (2000, 500), (90, 140, 30))
    exif = image.getexif()
    exif[0x0112] = 6  # rotated 90 degrees
    image.save(path, exif=exif)
    slicing = manager.plan_images([path], manager.default_settings()).images[0]
    assert slicing.size == (2000, 500) and slicing.grid[0] > slicing.grid[1]  # taller than wide: more rows
    assert prepare_inputs(manager.processor, image_question(path), manager.default_settings(), 32768).image_tokens == [slicing.tokens]
