"""JPEGs whose pixels the engine makes itself (docs/DECISIONS.md D43), checked on the CPU: a preparer that
leaves them out gives the prompt the processor gives, the engine's decode, resize and slices (app.model.jpegs,
run here on CPU tensors) give the processor's pixels bit for bit, what the GPU path cannot match stays on the
CPU, and a JPEG that cannot be decoded fails its own request alone."""

import os
import threading

import pytest
import torch
from PIL import Image
from torchvision.transforms.v2 import functional as tvF

from app import tuning
from app.engine import inputs
from app.engine.inputs import prepare_inputs
from app.engine.jpegs_on_device import DECODED_PIXELS, DEFERRED_IMAGES
from app.engine.settings import GenerationSettings
from app.errors import UserError
from app.media.images import jpeg_for_the_device
from app.model import jpegs
from app.model.jpegs import CPU, JpegsOnDevice, NoJpegsOnDevice, jpegs_for, processor_resized, resized, slices
from benchmarks.photo import write_photo

# (width, height): slices of 448 (1344 square: the source view alone is resized), a refined view resized
# too, one upscaled, a long thin one, one too small to slice, an odd size.
SIZES = [(1344, 1344), (1000, 750), (333, 517), (3000, 300), (64, 64), (1203, 877)]


def photo(folder, name: str, size: tuple[int, int], seed: int = 0, **save) -> str:
    """A JPEG like a photo (benchmarks/photo.py)."""
    return write_photo(os.path.join(str(folder), name), *size, seed=seed, **save)


def question(*paths: str) -> list[dict]:
    return [{"role": "user", "content": [*({"type": "image", "path": path} for path in paths),
                                         {"type": "text", "text": "What is in the picture?"}]}]


SETTINGS = GenerationSettings(max_new_tokens=8)


@pytest.mark.parametrize("mode", ["16x", "4x"])
def test_a_request_prepared_without_its_pixels_gets_the_processors_prompt_and_the_same_pixels(manager, tmp_path, mode):
    """Prompt ids, slice sizes, token counts as the processor makes them from the pixels; then the engine's
    slices from the JPEGs equal the processor's pixel_values, bit for bit (libjpeg-turbo decoding both)."""
    settings = GenerationSettings(max_new_tokens=8, downsample_mode=mode)
    paths = [photo(tmp_path, f"photo{i}.jpg", size, seed=i) for i, size in enumerate(SIZES)]
    for request in [[path] for path in paths] + [paths[:3]]:
        today = prepare_inputs(manager.processor, question(*request), settings, 32768)
        left = prepare_inputs(manager.processor, question(*request), settings, 32768, jpegs_on_device=True)
        deferred = left.tensors.pop(DEFERRED_IMAGES)
        pixels = today.tensors.pop("pixel_values")
        assert set(left.tensors) == set(today.tensors)
        for key, value in today.tensors.items():
            assert torch.equal(left.tensors[key], value), key
        assert (left.prompt_tokens, left.image_tokens) == (today.prompt_tokens, today.image_tokens)
        assert deferred.paths == tuple(request) and deferred.pixel_bytes == pixels.numel()
        assert torch.equal(slices(deferred, CPU, resize=resized), pixels), request  # the GPU's resize, on the CPU
        if request == paths[:3]:
            assert torch.equal(slices(deferred, CPU), pixels)  # where the engine makes them on its CPU


def test_the_resize_is_the_processors_uint8_resize_bit_for_bit(monkeypatch):
    """Against torchvision's resize on the CPU (the processor's), shrinking and growing by odd ratios."""
    generator = torch.Generator().manual_seed(0)
    image = torch.randint(0, 256, (3, 517, 333), dtype=torch.uint8, generator=generator)
    for height, width in [(448, 448), (56, 1008), (1400, 1400), (517, 112), (97, 333), (1, 5)]:
        expected = tvF.resize(image, [height, width], interpolation=tvF.InterpolationMode.BICUBIC, antialias=True)
        assert torch.equal(resized(image, height, width), expected), (height, width)
    monkeypatch.setattr(jpegs, "_PASS_PIXELS", 3 * 517 * 40)  # in pieces of 40 rows or columns, as a huge image
    assert torch.equal(resized(image, 448, 1000), processor_resized(image, 448, 1000))


def test_what_nvjpeg_cannot_match_is_decoded_by_the_preparer_and_sliced_by_the_engine(manager, tmp_path, monkeypatch):
    """Only a whole YCbCr JPEG needing no EXIF turn is left to the engine as its file; any other image (a PNG,
    a turned, grey or CMYK JPEG) is decoded by its preparer, and the engine makes every image's slices: the
    processor's pixels, bit for bit."""
    upright = Image.Exif()
    upright[0x0112] = 1
    turned = Image.Exif()
    turned[0x0112] = 6
    whole = photo(tmp_path, "whole.jpg", (640, 480))
    assert jpeg_for_the_device(whole) == (480, 640)
    assert jpeg_for_the_device(photo(tmp_path, "upright.jpg", (640, 480), exif=upright)) == (480, 640)
    assert jpeg_for_the_device(photo(tmp_path, "progressive.jpg", (640, 480), progressive=True)) == (480, 640)
    Image.open(whole).convert("L").save(tmp_path / "grey.jpg")
    Image.open(whole).convert("CMYK").save(tmp_path / "cmyk.jpg")
    Image.open(whole).save(tmp_path / "lossless.png")
    data = open(whole, "rb").read()
    (tmp_path / "truncated.jpg").write_bytes(data[: len(data) // 2])
    stays = [photo(tmp_path, "turned.jpg", (640, 480), exif=turned)] + [
        str(tmp_path / name) for name in ("grey.jpg", "cmyk.jpg", "lossless.png")]
    for path in stays:
        assert jpeg_for_the_device(path) is None, path
    request = question(whole, *stays)
    today = prepare_inputs(manager.processor, request, SETTINGS, 32768)
    mixed = prepare_inputs(manager.processor, request, SETTINGS, 32768, jpegs_on_device=True)
    deferred, decoded = mixed.tensors.pop(DEFERRED_IMAGES), mixed.tensors.pop(DECODED_PIXELS)
    assert [place is None for place in deferred.decoded] == [True, False, False, False, False]
    assert decoded.dtype == torch.uint8 and decoded.numel() == 3 * (640 * 480) * 4  # the turned one too, upright
    pixels = today.tensors.pop("pixel_values")
    assert set(mixed.tensors) == set(today.tensors) and mixed.prompt_tokens == today.prompt_tokens
    assert torch.equal(slices(deferred, CPU, resize=resized, pixels=decoded), pixels)  # the GPU's resize, on the CPU
    assert torch.equal(slices(deferred, CPU, pixels=decoded), pixels)
    # More decoded pixels than a request hands the engine: its preparer slices every image, as without the GPU path.
    monkeypatch.setattr(inputs, "DECODED_PIXELS_MAX_BYTES", decoded.numel() - 1)
    sliced_here = prepare_inputs(manager.processor, request, SETTINGS, 32768, jpegs_on_device=True)
    assert DEFERRED_IMAGES not in sliced_here.tensors and torch.equal(sliced_here.tensors["pixel_values"], pixels)
    with pytest.raises(UserError, match="could not be read"):  # refused by its preparer, as before
        prepare_inputs(manager.processor, question(str(tmp_path / "truncated.jpg")), SETTINGS, 32768, jpegs_on_device=True)


def corrupt_jpeg(folder) -> str:
    """A JPEG whose header and end are whole and whose compressed data is not: only decoding finds out."""
    data = bytearray(open(photo(folder, "to-break.jpg", (800, 600)), "rb").read())
    start = data.find(b"\xff\xda") + 20
    data[start:-2:7] = b"\xff" * len(range(start, len(data) - 2, 7))
    path = os.path.join(str(folder), "corrupt.jpg")
    open(path, "wb").write(bytes(data))
    return path


def test_a_jpeg_that_cannot_be_decoded_fails_its_own_request_alone(manager, tmp_path, monkeypatch):
    """The engine decodes a request's JPEGs as it stages them (here on the CPU, as where the GPU's staged
    pixels are full): a corrupt one is refused with the usual message while a reply beside it, its own
    image decoded the same way, goes on to the tokens it gives when prepared as before."""
    good = photo(tmp_path, "good.jpg", (1000, 750))
    long = GenerationSettings(max_new_tokens=400, min_new_tokens=400, do_sample=False)
    alone = list(manager.stream(question(good), long))[-1].text
    assert not manager.runner.jpegs.enabled  # the CPU: the preparers decode every image
    monkeypatch.setattr(manager.runner, "jpegs", JpegsOnDevice(CPU))
    assert DEFERRED_IMAGES in manager.preparer.prepare(question(good), long, 32768, jpegs_on_device=True).tensors
    streaming, replies = threading.Event(), []

    def victim():
        for update in manager.stream(question(good), long):
            streaming.set()
        replies.append(update.text)

    thread = threading.Thread(target=victim)
    thread.start()
    assert streaming.wait(60)
    with pytest.raises(UserError, match="“corrupt.jpg” could not be read as an image"):
        list(manager.stream(question(corrupt_jpeg(tmp_path)), SETTINGS))
    assert manager.active_generations == 1  # refused while the other reply streamed
    thread.join(60)
    assert replies == [alone]


def test_the_gpu_path_is_chosen_once_and_can_be_turned_off():
    assert "JPEG_ON_DEVICE" in tuning.FROM_ENVIRONMENT and tuning.JPEG_ON_DEVICE == 1
    assert isinstance(jpegs_for(torch.device("cuda"), wanted=False), NoJpegsOnDevice)


def test_a_png_sliced_by_the_engine_gets_the_reply_it_gets_when_sliced_by_its_preparer(manager, tmp_path, monkeypatch):
    """The engine making slices (here on the CPU) from a PNG its preparer decoded, beside a JPEG it decodes
    itself: the same greedy reply as when the preparer makes every slice."""
    png = str(tmp_path / "drawing.png")
    Image.open(photo(tmp_path, "drawing.jpg", (900, 700), seed=3)).save(png)
    both = question(png, photo(tmp_path, "other.jpg", (640, 480), seed=4))
    greedy = GenerationSettings(max_new_tokens=24, min_new_tokens=24, do_sample=False)
    before = list(manager.stream(both, greedy))[-1].text
    monkeypatch.setattr(manager.runner, "jpegs", JpegsOnDevice(CPU))
    prepared = manager.preparer.prepare(both, greedy, 32768, jpegs_on_device=True)
    assert [place is None for place in prepared.tensors[DEFERRED_IMAGES].decoded] == [False, True]
    manager.scheduler.conversations.clear()  # else the same question goes on from what the first one kept
    staged = []
    slices_made = jpegs.slices
    monkeypatch.setattr(jpegs, "slices", lambda *args, **kwargs: staged.append(1) or slices_made(*args, **kwargs))
    assert list(manager.stream(both, greedy))[-1].text == before and staged == [1]
