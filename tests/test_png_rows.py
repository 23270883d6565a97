"""A PNG's rows inflated by libdeflate and handed to libspng stored (app.media.png_rows, docs/DECISIONS.md D58): the
PNG written is sound (PIL checks its chunks' checksums and zlib its stream's) and gives the same pixels as the
PNG sent, for every kind of PNG, filter and layout of chunks; whatever it cannot take is left to libspng as it
is, and a broken PNG gives what libspng gives for it, but for streams only libdeflate takes."""

import io
import struct
import zlib

import numpy as np
import pytest
import pyspng
from PIL import Image

from app.media.png_rows import with_rows_stored
from tests.test_images import chunk

CHANNELS = {0: 1, 2: 3, 3: 1, 4: 2, 6: 4}


def filtered(rows: np.ndarray, bpp: int, filters: list[int]) -> bytes:
    """`rows` ([height, bytes a row], uint8) each preceded by its filter type and filtered by it (PNG's five)."""
    out, above = [], np.zeros(rows.shape[1], np.int32)
    for row, kind in zip(rows.astype(np.int32), filters):
        left = np.concatenate([np.zeros(bpp, np.int32), row[:-bpp]])
        above_left = np.concatenate([np.zeros(bpp, np.int32), above[:-bpp]])
        estimate = left + above - above_left
        distances = [np.abs(estimate - left), np.abs(estimate - above), np.abs(estimate - above_left)]
        paeth = np.where((distances[0] <= distances[1]) & (distances[0] <= distances[2]), left,
                         np.where(distances[1] <= distances[2], above, above_left))
        predicted = [0, left, above, (left + above) // 2, paeth][kind]
        out.append(bytes([kind]) + ((row - predicted) % 256).astype(np.uint8).tobytes())
        above = row
    return b"".join(out)


def png(width: int, height: int, colour_type: int = 2, bit_depth: int = 8, idat_bytes: int = 8192, seed: int = 0,
        before: bytes = b"", after: bytes = b"", level: int = 6) -> bytes:
    """A PNG of noise and flat runs, each row filtered by a filter of its own, its stream cut into IDAT chunks of
    `idat_bytes`; `before` and `after` are chunks around them."""
    rng = np.random.default_rng(seed)
    row_bytes = -(-width * CHANNELS[colour_type] * bit_depth // 8)
    rows = rng.integers(0, 256, (height, row_bytes), dtype=np.uint8)
    rows[::3, : row_bytes // 2] = 7  # something to compress
    bpp = max(1, CHANNELS[colour_type] * bit_depth // 8)
    stream = zlib.compress(filtered(rows, bpp, list(rng.integers(0, 5, height))), level)
    header = struct.pack(">IIBBBBB", width, height, bit_depth, colour_type, 0, 0, 0)
    palette = chunk(b"PLTE", bytes(range(2**bit_depth)) * 3) if colour_type == 3 else b""
    idats = b"".join(chunk(b"IDAT", stream[i:i + idat_bytes]) for i in range(0, len(stream), idat_bytes))
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + palette + before + idats + after + chunk(b"IEND", b"")


def pixels(data: bytes):
    try:
        return pyspng.load(data, "RGB")
    except RuntimeError:
        return None


def idat_data(data: bytes) -> bytes:
    place, parts = 8, []
    while data[place + 4:place + 8] != b"IEND":
        length = struct.unpack(">I", data[place:place + 4])[0]
        if data[place + 4:place + 8] == b"IDAT":
            parts.append(data[place + 8:place + 8 + length])
        place += 12 + length
    return b"".join(parts)


def sound_and_the_same(data: bytes) -> None:
    stored = with_rows_stored(data)
    assert stored is not None
    assert zlib.decompress(idat_data(stored)) == zlib.decompress(idat_data(data))  # the stream's checksum too
    assert np.array_equal(pyspng.load(stored, "RGBA"), pyspng.load(data, "RGBA"))
    checked = Image.open(io.BytesIO(stored))
    checked.verify()  # every chunk's checksum
    assert np.array_equal(np.asarray(Image.open(io.BytesIO(stored))), np.asarray(Image.open(io.BytesIO(data))))


@pytest.mark.parametrize("colour_type, bit_depth", [(2, 8), (6, 8), (0, 8), (4, 8), (3, 8), (2, 16), (6, 16),
                                                    (0, 1), (0, 2), (0, 4), (3, 4), (0, 16)])
@pytest.mark.parametrize("width, height", [(1, 1), (37, 23), (64, 5)])
def test_every_kind_of_png_gives_the_same_pixels(colour_type, bit_depth, width, height):
    sound_and_the_same(png(width, height, colour_type, bit_depth))


def test_the_chunks_around_the_rows_stay_where_they_were():
    text = chunk(b"tEXt", b"Comment\0before the rows")
    after = chunk(b"tEXt", b"Comment\0after them")
    data = png(40, 30, before=chunk(b"gAMA", struct.pack(">I", 45455)) + text, after=after)
    stored = with_rows_stored(data)
    sound_and_the_same(data)
    assert stored.index(text) < stored.index(b"IDAT") < stored.index(after) < stored.index(b"IEND")
    assert Image.open(io.BytesIO(stored)).text == Image.open(io.BytesIO(data)).text


@pytest.mark.parametrize("idat_bytes", [1, 100, 2**20])
def test_however_the_stream_is_cut_into_chunks(idat_bytes):
    sound_and_the_same(png(50, 40, idat_bytes=idat_bytes))


def test_many_stored_blocks_and_a_stream_of_whole_ones():
    sound_and_the_same(png(1700, 1700, idat_bytes=2**16, level=1))  # 8.7 MB of rows: 133 stored blocks
    sound_and_the_same(png(21844, 3, colour_type=0))  # 3 x 21,845 bytes: one full stored block, no partial one


def test_rows_past_the_limit_are_left_to_libspng(tmp_path, monkeypatch):
    """Their PNG as it is: the PNG written would hold the rows whole, where a compressible one is a fraction."""
    from app.media import png_rows
    from app.media.images import load_image_pixels

    data = png(40, 30)  # 30 x 121 bytes of rows
    monkeypatch.setattr(png_rows, "MAX_ROWS_BYTES", 30 * 121 - 1)
    assert with_rows_stored(data) is None
    path = tmp_path / "large.png"
    path.write_bytes(data)
    assert np.array_equal(load_image_pixels(str(path), True).permute(1, 2, 0).numpy(), pyspng.load(data, "RGB"))
    monkeypatch.setattr(png_rows, "MAX_ROWS_BYTES", 30 * 121)
    sound_and_the_same(data)


def test_the_benchmarks_kind_of_png_saved_by_pil(tmp_path):
    path = tmp_path / "noise.png"
    Image.fromarray(np.random.default_rng(1).integers(0, 256, (300, 400, 3), dtype=np.uint8)).save(path)
    sound_and_the_same(path.read_bytes())


def with_header(data: bytes, height: int, interlaced: int = 0) -> bytes:
    """`data` with its IHDR saying `height` rows and `interlaced`, its checksum made right."""
    header = data[16:20] + struct.pack(">I", height) + data[24:28] + bytes([interlaced])
    return data[:8] + chunk(b"IHDR", header) + data[33:]


def test_what_it_does_not_take_is_left_as_it_is():
    data = png(20, 10)
    two_runs = png(20, 10, idat_bytes=100)
    cut = two_runs.index(b"IDAT", two_runs.index(b"IDAT") + 4) - 4
    last_stream_byte = data.index(b"IEND") - 9  # before the last IDAT's checksum and IEND's length
    cases = {
        "not a PNG": b"GIF89a" + data[6:],
        "interlaced": with_header(data, 10, interlaced=1),
        "two runs of IDAT chunks": two_runs[:cut] + chunk(b"tEXt", b"a\0b") + two_runs[cut:],
        "no IDAT chunk": data[:33] + chunk(b"IEND", b""),
        "a chunk past the end": data[:-6],
        "no IEND": data[:-12],
        "fewer rows than its header says": with_header(data, 11),
        "more rows than its header says": with_header(data, 9),
        "a stream whose checksum is wrong": data[:last_stream_byte] + bytes([data[last_stream_byte] ^ 1])
        + data[last_stream_byte + 1:],
    }
    assert with_rows_stored(with_header(data, 10)) is not None
    for name, broken in cases.items():
        assert with_rows_stored(broken) is None, name


def test_a_broken_png_gives_what_libspng_gives_for_it():
    """Bytes changed anywhere (checksums left wrong, as an attacker may send them): libspng's pixels or its
    refusal, the same as for the PNG as it is, but for the streams only libdeflate takes (below)."""
    rng = np.random.default_rng(3)
    original = png(24, 16, idat_bytes=200)
    outcomes = {"same pixels": 0, "refused by both": 0}
    for _ in range(1500):
        broken = bytearray(original)
        for place in rng.integers(8, len(broken), rng.integers(1, 4)):
            broken[place] = rng.integers(0, 256)
        broken = bytes(broken)
        expected, got = pixels(broken), pixels(with_rows_stored(broken) or broken)
        if expected is None and got is not None:
            with pytest.raises(zlib.error):  # a stream only libdeflate takes
                zlib.decompress(idat_data(broken))
            continue
        assert (got is None) == (expected is None)
        outcomes["refused by both" if expected is None else "same pixels"] += 1
        assert expected is None or np.array_equal(got, expected)
    assert min(outcomes.values()) > 100, outcomes


def fixed_huffman_stream(length_symbol: int) -> bytes:
    """A zlib stream of one fixed-Huffman block: a literal 0, then a match of `length_symbol` (285: 258 bytes)
    at distance 1, then the block's end; 259 zeros, its checksum theirs."""
    codes = [(0b00110000, 8), (0b11000000 + length_symbol - 280, 8), (0, 5), (0, 7)]  # 0; the length; distance 1; end
    bits = [1, 1, 0]  # BFINAL, then BTYPE 01 (fixed) from its low bit
    for code, length in codes:
        bits += [(code >> (length - 1 - i)) & 1 for i in range(length)]  # Huffman codes go from their high bit
    bits += [0] * (-len(bits) % 8)
    block = bytes(sum(bit << i for i, bit in enumerate(bits[start:start + 8])) for start in range(0, len(bits), 8))
    return b"\x78\x01" + block + struct.pack(">I", zlib.adler32(bytes(259)))


def test_a_stream_only_libdeflate_takes_is_decoded():
    """RFC 1951 has no length symbols 286 and 287; zlib refuses them, and libdeflate reads them as 258, as it
    takes code counts past 286 and 30 (a helper's attack: 14 of 15,328 single bits changed in small PNGs' streams;
    none gave other pixels where both decoded). Such a PNG, refused before, is decoded."""
    header = chunk(b"IHDR", struct.pack(">IIBBBBB", 86, 1, 8, 2, 0, 0, 0))
    sound, lenient = (b"\x89PNG\r\n\x1a\n" + header + chunk(b"IDAT", fixed_huffman_stream(symbol)) + chunk(b"IEND", b"")
                      for symbol in (285, 287))
    assert np.array_equal(pixels(with_rows_stored(sound)), np.zeros((1, 86, 3), np.uint8))
    assert pixels(sound) is not None and pixels(lenient) is None
    with pytest.raises(zlib.error):
        zlib.decompress(idat_data(lenient))
    assert np.array_equal(pixels(with_rows_stored(lenient)), np.zeros((1, 86, 3), np.uint8))
