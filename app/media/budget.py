"""The visual-token budget: how the processor cuts an image at a given slice count, what that costs, and the
slice count that fits.

Counts come from the checkpoint's own image processor geometry (source view + slice grid), so they
match what the processor will emit without touching a pixel.
"""

from dataclasses import dataclass

from app.messages import MSG_OVER_VISUAL_BUDGET
from app.errors import UserError


@dataclass(frozen=True)
class ImageSlicing:
    """How the image processor sees one image: the whole image resized to `source` (its source view) and,
    with a `grid` of (rows, cols), the image resized to `refined` and cut into that many equal slices.
    Sizes are (height, width) in pixels."""

    size: tuple[int, int]
    source: tuple[int, int]
    grid: tuple[int, int] | None
    refined: tuple[int, int] | None
    source_tokens: int
    slice_tokens: int  # each slice's; 0 without slices

    @property
    def slice_count(self) -> int:
        return self.grid[0] * self.grid[1] if self.grid else 0

    @property
    def slice_size(self) -> tuple[int, int] | None:
        if not self.grid:
            return None
        return self.refined[0] // self.grid[0], self.refined[1] // self.grid[1]

    @property
    def tokens(self) -> int:
        return self.source_tokens + self.slice_count * self.slice_tokens

    def views_in_patches(self, patch: int) -> list[list[int]]:
        """The (height, width) in patches of the source view, then of each slice: the processor's target sizes."""
        views = [[self.source[0] // patch, self.source[1] // patch]]
        if self.grid:
            views += [[self.slice_size[0] // patch, self.slice_size[1] // patch]] * self.slice_count
        return views


def image_slicing(image_processor, height: int, width: int, max_slice_nums: int, downsample_mode: str) -> ImageSlicing:
    """The cut MiniCPM-V's image processor makes (its get_sliced_grid, find_best_resize, get_refine_size)."""
    patch = image_processor.patch_size
    resolution = image_processor.scale_resolution
    divisor = 4 if downsample_mode == "4x" else 16
    grid = None
    if image_processor.slice_mode:
        grid = image_processor.get_sliced_grid((height, width), max_slice_nums, resolution)
    source = image_processor.find_best_resize(
        (height, width), resolution, patch, downsample_mode=downsample_mode, allow_upscale=grid is None
    )
    source_tokens = (source[0] // patch) * (source[1] // patch) // divisor
    if grid is None:
        return ImageSlicing((height, width), tuple(source), None, None, source_tokens, 0)
    rows, cols = grid
    refined = image_processor.get_refine_size(
        (height, width), grid, resolution, patch, downsample_mode=downsample_mode, allow_upscale=True
    )
    slice_tokens = ((refined[0] // rows) // patch) * ((refined[1] // cols) // patch) // divisor
    return ImageSlicing((height, width), tuple(source), (rows, cols), tuple(refined), source_tokens, slice_tokens)


def image_token_count(image_processor, height: int, width: int, max_slice_nums: int, downsample_mode: str) -> int:
    return image_slicing(image_processor, height, width, max_slice_nums, downsample_mode).tokens


@dataclass(frozen=True)
class SlicePlan:
    """One max-slices value for every image of a request, and how each image is then cut and what it costs."""

    max_slice_nums: int
    requested_slice_nums: int
    images: tuple[ImageSlicing, ...]
    budget: int

    @property
    def tokens_per_image(self) -> tuple[int, ...]:
        return tuple(image.tokens for image in self.images)

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
                f"{len(self.images)} images fit the {self.budget:,}-token visual budget.")


def plan_slices(image_processor, sizes: list[tuple[int, int]], max_slice_nums: int, downsample_mode: str,
                budget: int) -> SlicePlan:
    """Largest max_slice_nums <= the requested one whose total cost over all images fits the budget.

    Lowering a shared cap only shrinks the large images: a small image already costs one source view.
    """
    for slice_nums in range(max_slice_nums, 0, -1):
        images = tuple(image_slicing(image_processor, h, w, slice_nums, downsample_mode) for h, w in sizes)
        if sum(image.tokens for image in images) <= budget:
            return SlicePlan(slice_nums, max_slice_nums, images, budget)
    raise UserError(MSG_OVER_VISUAL_BUDGET.format(count=len(sizes), needed=sum(image.tokens for image in images),
                                                  budget=budget))
