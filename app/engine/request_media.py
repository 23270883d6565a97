"""What media one request may hold: up to MAX_IMAGES_PER_REQUEST images of up to MAX_REQUEST_IMAGE_PIXELS
together (from their headers: a preparer decodes each whole before it is cut), or one video alone. A
conversation past it goes on without its oldest turns (app.engine.inputs.prepare_inputs); a last turn past it
is refused, with the message that says which limit."""

from app import limits
from app.errors import UserError
from app.media.images import image_size
from app.messages import MSG_IMAGES_TOO_LARGE_TOGETHER, MSG_ONE_VIDEO, MSG_TOO_MANY_IMAGES


def media_paths(messages: list[dict], kind: str) -> list[str]:
    return [part["path"] for message in messages for part in message["content"] if part["type"] == kind]


def media_fit(messages: list[dict], sizes: dict) -> bool:
    """Whether one request may hold these messages' media. `sizes` caches the images' sizes by path."""
    image_paths, video_paths = media_paths(messages, "image"), media_paths(messages, "video")
    if video_paths:
        return len(video_paths) == 1 and not image_paths
    return len(image_paths) <= limits.MAX_IMAGES_PER_REQUEST and _pixels(image_paths, sizes) <= limits.MAX_REQUEST_IMAGE_PIXELS


def check_media_fit(messages: list[dict], sizes: dict) -> None:
    """Refuse these messages' media if one request may not hold them, saying which limit they pass."""
    if media_fit(messages, sizes):
        return
    image_paths = media_paths(messages, "image")
    if media_paths(messages, "video"):
        raise UserError(MSG_ONE_VIDEO)
    if len(image_paths) > limits.MAX_IMAGES_PER_REQUEST:
        raise UserError(MSG_TOO_MANY_IMAGES.format(count=len(image_paths), limit=limits.MAX_IMAGES_PER_REQUEST))
    raise UserError(MSG_IMAGES_TOO_LARGE_TOGETHER.format(pixels=_pixels(image_paths, sizes),
                                                         limit=limits.MAX_REQUEST_IMAGE_PIXELS))


def image_sizes(paths: list[str], sizes: dict) -> list[tuple[int, int]]:
    """Each image's (height, width) upright, from its header, read once into `sizes` (by path)."""
    for path in paths:
        if path not in sizes:
            sizes[path] = image_size(path)
    return [sizes[path] for path in paths]


def _pixels(paths: list[str], sizes: dict) -> int:
    """The images' pixels together (an image sent twice counts once: it is decoded once)."""
    unique = list(set(paths))
    return sum(height * width for height, width in image_sizes(unique, sizes))
