"""The visual-token budget: what an image costs at a given slice count, and the slice count that fits.

Counts come from the checkpoint's own image processor geometry (source view + slice grid), so they
match what the processor will emit without touching a pixel.
"""

from dataclasses import dataclass

from app.messages import MSG_OVER_VISUAL_BUDGET
from app.errors import UserError


def image_token_count(image_processor, height: int, width: int, max_slice_nums: int, downsample_mode: str) -> int:
    patch = image_processor.patch_size
    resolution = image_processor.scale_resolution
    divisor = 4 if downsample_mode == "4x" else 16
    grid = None
    if image_processor.slice_mode:
        grid = image_processor.get_sliced_grid((height, width), max_slice_nums, resolution)
    source_h, source_w = image_processor.find_best_resize(
        (height, width), resolution, patch, downsample_mode=downsample_mode, allow_upscale=grid is None
    )
    tokens = (source_h // patch) * (source_w // patch) // divisor
    if grid is not None:
        rows, cols = grid
        refine_h, refine_w = image_processor.get_refine_size(
            (height, width), grid, resolution, patch, downsample_mode=downsample_mode, allow_upscale=True
        )
        slice_tokens = ((refine_h // rows) // patch) * ((refine_w // cols) // patch) // divisor
        tokens += rows * cols * slice_tokens
    return tokens


@dataclass(frozen=True)
class SlicePlan:
    """One max-slices value for every image of a request, and what each image then costs."""

    max_slice_nums: int
    requested_slice_nums: int
    tokens_per_image: tuple[int, ...]
    budget: int

    @property
    def total_tokens(self) -> int:
        return sum(self.tokens_per_image)

    @property
    def lowered(self) -> bool:
        return self.max_slice_nums < self.requested_slice_nums

    def notice(self) -> str | None:
        if not self.lowered:
            return None
        return (f"Max slices lowered from {self.requested_slice_nums} to {self.max_slice_nums} so that "
                f"{len(self.tokens_per_image)} images fit the {self.budget:,}-token visual budget.")


def plan_slices(image_processor, sizes: list[tuple[int, int]], max_slice_nums: int, downsample_mode: str,
                budget: int) -> SlicePlan:
    """Largest max_slice_nums <= the requested one whose total cost over all images fits the budget.

    Lowering a shared cap only shrinks the large images: a small image already costs one source view.
    """
    for slice_nums in range(max_slice_nums, 0, -1):
        counts = tuple(image_token_count(image_processor, h, w, slice_nums, downsample_mode) for h, w in sizes)
        if sum(counts) <= budget:
            return SlicePlan(slice_nums, max_slice_nums, counts, budget)
    raise UserError(MSG_OVER_VISUAL_BUDGET.format(count=len(sizes), needed=sum(counts), budget=budget))
