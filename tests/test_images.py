"""Loading an uploaded image (app.media.images): what is transparent lands on white, as a page shows it,
the same way for the model's pixels and the previews; each kind of PNG gives PIL's pixels, whichever decoder
reads it; a PNG broken past its header is refused, not fatal (docs/DECISIONS.md D52)."""

import struct
import zlib

import numpy as np
import pytest
import torch
from PIL import Image, PngImagePlugin

from app.errors import UserError
from app.media.images import image_size, load_image, load_image_pixels, load_thumbnail
from tests.test_hardening import corrupt_png, garbage_png


def black_text_on_transparent(mode: str) -> Image.Image:
    """A 64x48 image, transparent but for a black bar, in `mode`."""
    image = Image.new("RGBA", (64, 48), (0, 0, 0, 0))
    image.paste((0, 0, 0, 255), (8, 20, 56, 28))
    if mode == "P":
        paletted = Image.new("P", image.size, 0)
        paletted.putpalette([0, 0, 0, 0, 0, 0])
        paletted.paste(1, (8, 20, 56, 28))
        paletted.info["transparency"] = 0
        return paletted
    return image.convert(mode)


@pytest.mark.parametrize("mode, extension", [("RGBA", "png"), ("LA", "png"), ("P", "png"), ("RGBA", "webp"), ("P", "gif")])
def test_what_is_transparent_lands_on_white(tmp_path, mode, extension):
    path = str(tmp_path / f"text.{extension}")
    image = black_text_on_transparent(mode)
    image.save(path, **({"lossless": True} if extension == "webp" else {}),
               **({"transparency": 0} if mode == "P" else {}))
    pixels = load_image_pixels(path)
    assert pixels.shape == (3, 48, 64) and pixels.dtype == torch.uint8
    assert pixels[:, 0, 0].tolist() == [255, 255, 255]  # the background, once transparent
    assert pixels[:, 24, 32].tolist() == [0, 0, 0]  # the bar
    assert torch.equal(pixels, torch.from_numpy(np.array(load_image(path))).permute(2, 0, 1))
    assert load_thumbnail(path, 32).getpixel((0, 0)) == (255, 255, 255)  # the preview shows what the model gets


def test_half_transparent_pixels_are_blended_with_white(tmp_path):
    path = str(tmp_path / "half.png")
    Image.new("RGBA", (4, 4), (0, 0, 200, 128)).save(path)
    red, green, blue = load_image_pixels(path)[:, 0, 0].tolist()
    assert red == green and abs(red - 127) <= 1 and abs(blue - 227) <= 1


@pytest.mark.parametrize("may_hold_gil", [False, True], ids=["OpenCV", "libspng"])
def test_an_opaque_png_is_decoded_as_it_was(tmp_path, may_hold_gil):
    path = str(tmp_path / "opaque.png")
    noise = np.random.default_rng(0).integers(0, 256, (40, 30, 3), dtype=np.uint8)
    Image.fromarray(noise).save(path)
    pixels = load_image_pixels(path, may_hold_gil)
    assert torch.equal(pixels, torch.from_numpy(noise).permute(2, 0, 1))
    # Rows of pixels, as the engine takes them (app.engine.jpegs_on_device): flattened with no copy.
    assert pixels.permute(1, 2, 0).is_contiguous()


@pytest.mark.parametrize("may_hold_gil", [False, True], ids=["OpenCV", "libspng"])
def test_every_kind_of_png_gives_what_pil_gives(tmp_path, may_hold_gil):
    """8-bit RGB PNGs are decoded by OpenCV or libspng, every other kind by PIL: each as load_image's pixels."""
    noise = np.random.default_rng(1).integers(0, 256, (30, 50, 3), dtype=np.uint8)
    turned = Image.fromarray(noise)
    exif = turned.getexif()
    exif[0x0112] = 6  # turned a quarter: the image is shown upright, 30 wide
    kinds = {"rgb": Image.fromarray(noise), "grey": Image.fromarray(noise[..., 0]), "rgb16": None, "turned": turned}
    for name, image in kinds.items():
        path = str(tmp_path / f"{name}.png")
        if name == "rgb16":
            import cv2

            cv2.imwrite(path, noise.astype(np.uint16) * 257)
        else:
            image.save(path, **({"exif": exif} if name == "turned" else {}))
        expected = torch.from_numpy(np.array(load_image(path))).permute(2, 0, 1)
        assert torch.equal(load_image_pixels(path, may_hold_gil), expected), name
    assert load_image_pixels(str(tmp_path / "turned.png"), may_hold_gil).shape == (3, 50, 30)


def chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def exif_chunk(orientation: int) -> bytes:
    exif = Image.Exif()
    exif[0x0112] = orientation
    return chunk(b"eXIf", exif.tobytes())


def with_chunks(path: str, chunks: bytes, before_the_pixels: bool = False) -> None:
    """`chunks` put just before IEND, after the pixels, or just after IHDR, before them (PNG allows both)."""
    png = open(path, "rb").read()
    at = 8 + 25 if before_the_pixels else png.rindex(b"IEND") - 4
    open(path, "wb").write(png[:at] + chunks + png[at:])


def with_exif_after_the_pixels(path: str, orientation: int) -> None:
    """An eXIf chunk saying `orientation` put just before IEND, after the pixels (PNG allows it there)."""
    with_chunks(path, exif_chunk(orientation))


def test_a_pngs_turn_is_read_without_decoding_it_wherever_its_exif_lies(tmp_path, monkeypatch):
    """PIL's getexif() decodes a whole PNG to look for an eXIf chunk after its pixels (0.9 s and 275 MB for an
    8000x8000 one, in the header checks every request makes): the chunks are read instead."""
    noise = np.random.default_rng(3).integers(0, 256, (30, 50, 3), dtype=np.uint8)
    before, after, plain = (str(tmp_path / f"{name}.png") for name in ("before", "after", "plain"))
    exif = Image.Exif()
    exif[0x0112] = 6
    Image.fromarray(noise).save(before, exif=exif)
    Image.fromarray(noise).save(after)
    with_exif_after_the_pixels(after, 6)
    Image.fromarray(noise).save(plain)
    for path in (before, after):
        assert torch.equal(load_image_pixels(path), torch.from_numpy(np.array(load_image(path))).permute(2, 0, 1))
        assert load_image_pixels(path).shape == (3, 50, 30)

    def decoded(*args, **kwargs):
        raise AssertionError("the pixels were decoded")

    monkeypatch.setattr(PngImagePlugin.PngImageFile, "load", decoded)
    assert image_size(before) == image_size(after) == (50, 30) and image_size(plain) == (30, 50)


def corrupt_rgba_png(tmp_path) -> str:
    path = str(tmp_path / "rgba.png")
    Image.fromarray(np.random.default_rng(2).integers(0, 256, (60, 80, 4), dtype=np.uint8)).save(path)
    data = bytearray(open(path, "rb").read())
    start = data.find(b"IDAT") + 4 + 40
    data[start:start + 8] = bytes(255 - byte for byte in data[start:start + 8])
    open(path, "wb").write(bytes(data))
    return path


@pytest.mark.parametrize("may_hold_gil", [False, True], ids=["OpenCV", "libspng"])
@pytest.mark.parametrize("broken", [corrupt_png, garbage_png, corrupt_rgba_png])
def test_a_png_broken_past_its_header_is_refused(tmp_path, broken, may_hold_gil):
    with pytest.raises(UserError, match="could not be read as an image"):
        load_image_pixels(broken(tmp_path), may_hold_gil)


@pytest.mark.parametrize("before_the_pixels", [True, False])
def test_a_png_of_too_many_chunks_is_refused_before_any_decoder_reads_them(tmp_path, monkeypatch, before_the_pixels):
    """16.6 M empty chunks (199 MB) held PIL's opening 49 s and 2.9 GB (a helper's attack): the chunks are
    counted from their headers first, and one past MAX_PNG_CHUNKS is refused wherever it is read."""
    from app import limits
    from app.media.images import check_image

    monkeypatch.setattr(limits, "MAX_PNG_CHUNKS", 50)
    fine, stuffed = str(tmp_path / "fine.png"), str(tmp_path / "stuffed.png")
    for path, count in ((fine, 40), (stuffed, 60)):
        Image.new("RGB", (64, 48), (10, 200, 30)).save(path)
        with_chunks(path, chunk(b"abCd", b"") * count, before_the_pixels)
    assert load_image_pixels(fine, True)[:, 0, 0].tolist() == [10, 200, 30]
    for read in (check_image, image_size, load_image, lambda path: load_thumbnail(path, 32),
                 load_image_pixels, lambda path: load_image_pixels(path, True)):
        with pytest.raises(UserError, match="could not be read as an image"):
            read(stuffed)


def test_a_png_whose_chunks_are_out_of_order_or_that_turns_twice_is_refused(tmp_path):
    """IHDR comes first; one eXIf chunk at most (PIL's preview and the model would each take another)."""
    path = str(tmp_path / "twice.png")
    Image.new("RGB", (30, 50), (1, 2, 3)).save(path)
    with_chunks(path, exif_chunk(1), before_the_pixels=True)
    assert image_size(path) == (50, 30)
    with_chunks(path, exif_chunk(6))
    with pytest.raises(UserError, match="could not be read as an image"):
        image_size(path)
    first = str(tmp_path / "first.png")
    Image.new("RGB", (30, 50), (1, 2, 3)).save(first)
    png = open(first, "rb").read()
    open(first, "wb").write(png[:8] + chunk(b"tEXt", b"Comment\0before IHDR") + png[8:])
    with pytest.raises(UserError, match="could not be read as an image"):
        load_image_pixels(first, True)
