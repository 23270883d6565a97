"""A synthetic image that compresses like a photo: smooth light, a few sharp-edged shapes, texture and grain.
Noise alone (real_shape.benchmark_request's) is the slow case to decode and makes a JPEG about four times
a photo's size; this is the common one."""

import numpy as np
from PIL import Image


def photo_pixels(width: int, height: int, seed: int = 0) -> np.ndarray:
    """[height, width, 3] uint8."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width] / max(width, height)
    light = np.stack([180 * (1 - y) + 40 * np.sin(9 * x), 120 + 90 * x * y, 200 * y + 30 * np.cos(13 * x * y)], -1)
    for _ in range(6):  # discs and bars with sharp edges, each its own colour
        cx, cy, r = rng.uniform(0.1, 0.9), rng.uniform(0.1, 0.9), rng.uniform(0.03, 0.15)
        shape = (x - cx) ** 2 + (y - cy) ** 2 < r * r if rng.random() < 0.5 else (abs(x - cx) < r) & (abs(y - cy) < r / 4)
        light[shape] = rng.uniform(20, 235, 3)
    for scale, amplitude in ((64, 25), (16, 14), (4, 8)):  # texture at a few scales, as foliage or fabric
        coarse = rng.normal(0, amplitude, (height // scale + 2, width // scale + 2)).astype(np.float32)
        light += np.asarray(Image.fromarray(coarse, "F").resize((width, height), Image.BICUBIC))[..., None]
    return np.clip(light + rng.normal(0, 4, light.shape), 0, 255).astype(np.uint8)


def write_photo(path: str, width: int, height: int, seed: int = 0, quality: int = 90, **save) -> str:
    """The image as a JPEG (quality 90, 4:2:0 as PIL saves it) or, by `path`'s extension, another format."""
    Image.fromarray(photo_pixels(width, height, seed)).save(path, quality=quality, **save)
    return path
