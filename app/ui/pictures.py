"""The pictures of what the model will see, drawn with PIL: an image with the cut the processor will make
(its source view beside it, then its grid of slices), and a video's sampled frames with their times."""

from PIL import Image, ImageDraw, ImageFont

from app.media.budget import ImageSlicing

SLICED_SIDE = 360  # the longest side of the sliced image's picture, in pixels
FRAME_SIDE = 256  # the longest side of a sampled frame's thumbnail
_MIN_SOURCE_SIDE = 72  # a source view shown smaller than this would not be seen
_GAP, _LABEL_HEIGHT = 12, 22
_BACKGROUND = (243, 244, 246)
_LABEL_COLOR = (55, 65, 81)


def slice_lines(width: int, height: int, grid: tuple[int, int]) -> tuple[list[int], list[int]]:
    """Where the slices of a rows x cols `grid` meet on a picture of width x height: the processor cuts
    the (resized) image into equal slices, so at equal fractions of each side. (xs, ys), inner lines only."""
    rows, cols = grid
    return [round(col * width / cols) for col in range(1, cols)], [round(row * height / rows) for row in range(1, rows)]


def _font(size: int):
    try:
        return ImageFont.load_default(size=size)
    except (TypeError, OSError):  # a Pillow without FreeType: its fixed bitmap font
        return ImageFont.load_default()


def _outlined(draw: ImageDraw.ImageDraw, box: tuple[int, int, int, int]) -> None:
    draw.rectangle(box, outline=(17, 24, 39), width=2)


def slicing_picture(image: Image.Image, slicing: ImageSlicing) -> Image.Image:
    """`image` (a thumbnail) as the processor will see it: its source view, then, if it is sliced, the image
    with its grid of slices drawn on; the source view is drawn at its size relative to the sliced image's."""
    sliced = image.copy()
    sliced.thumbnail((SLICED_SIDE, SLICED_SIDE))
    if slicing.grid is None:
        tiles = [(sliced, "source view only")]
    else:
        scale = min(1.0, max(slicing.source[1] / slicing.refined[1], _MIN_SOURCE_SIDE / max(sliced.size)))
        source = sliced.resize((max(1, round(sliced.width * scale)), max(1, round(sliced.height * scale))))
        tiles = [(source, "source view"), (draw_grid(sliced, slicing.grid), f"{slicing.grid[1]} x {slicing.grid[0]} slices")]
    width = sum(tile.width for tile, _ in tiles) + _GAP * (len(tiles) + 1)
    height = max(tile.height for tile, _ in tiles) + _LABEL_HEIGHT + 2 * _GAP
    canvas = Image.new("RGB", (width, height), _BACKGROUND)
    draw = ImageDraw.Draw(canvas)
    font = _font(16)
    left = _GAP
    for tile, label in tiles:
        canvas.paste(tile, (left, _GAP))
        _outlined(draw, (left - 1, _GAP - 1, left + tile.width, _GAP + tile.height))
        draw.text((left, _GAP + tile.height + 5), label, fill=_LABEL_COLOR, font=font)
        left += tile.width + _GAP
    return canvas


def draw_grid(picture: Image.Image, grid: tuple[int, int]) -> Image.Image:
    """`picture` with the slices' edges drawn on: dark lines with a light core, seen on any image."""
    drawn = picture.copy()
    draw = ImageDraw.Draw(drawn)
    xs, ys = slice_lines(drawn.width, drawn.height, grid)
    for color, width in (((17, 24, 39), 3), ((255, 255, 255), 1)):
        for x in xs:
            draw.line([(x, 0), (x, drawn.height)], fill=color, width=width)
        for y in ys:
            draw.line([(0, y), (drawn.width, y)], fill=color, width=width)
    return drawn


def clock(seconds: float) -> str:
    """A time in a video: 4.5 s, 1:02.5, 1:00:02.5."""
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, rest = divmod(seconds, 60)
    hours, minutes = divmod(int(minutes), 60)
    return f"{hours}:{minutes:02d}:{rest:04.1f}" if hours else f"{minutes}:{rest:04.1f}"
