"""A PNG whose compressed rows are inflated by libdeflate and handed on stored, for libspng to unfilter.

libspng inflates a PNG's rows with zlib, 17-19 of its 20 ms for the benchmark's 1344x1344 noise PNG on a dev
core; libdeflate inflates the same stream in 10. `with_rows_stored` gives the same PNG with its IDAT chunks
replaced by IDAT chunks holding those rows in stored (uncompressed) deflate blocks: libspng then only copies them
and undoes the rows' filters, and gives the same pixels (docs/DECISIONS.md D58).
"""

import struct

import deflate

from app import limits

_SIGNATURE = b"\x89PNG\r\n\x1a\n"
_CHANNELS = {0: 1, 2: 3, 3: 1, 4: 2, 6: 4}  # by IHDR's colour type
_STORED_BLOCK = 65535  # the most a stored deflate block holds
_BLOCKS_A_CHUNK = 128  # in each IDAT chunk written (8 MB): under pyspng's limit on a chunk's size (64 MB)
_ZLIB_HEADER = b"\x78\x01"  # deflate, a 32 KB window, no dictionary (a multiple of 31, as zlib requires)


def with_rows_stored(data: bytes) -> bytes | None:
    """`data`, a PNG, with its rows inflated and stored; None where libspng should take it as it is: not a PNG
    laid out as expected (IHDR first, one run of IDAT chunks, IEND), interlaced, or with a stream that does not
    inflate, checksum and all, to exactly its rows' size (libspng then refuses it, or decodes what it can)."""
    layout = _idat_run(memoryview(data))
    if layout is None:
        return None
    first, end, compressed = layout
    del layout  # the compressed rows go once inflated: a large PNG is held at most three times over
    width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
    bit_depth, colour_type, interlaced = data[24], data[25], data[28]
    if interlaced or colour_type not in _CHANNELS:
        return None
    size = height * (1 + -(-width * _CHANNELS[colour_type] * bit_depth // 8))
    try:
        rows = deflate.zlib_decompress(compressed, size)
    except deflate.DeflateError:
        return None
    del compressed
    if len(rows) != size:  # fewer rows than the header says (libdeflate refuses more), or a size past 2^32,
        return None        # which the `deflate` package takes modulo 2^32
    return _stored(memoryview(data)[:first], rows, memoryview(data)[end:])


def _idat_run(view: memoryview) -> tuple[int, int, bytes] | None:
    """(where the IDAT chunks start, where they end, their data joined), walking the chunks' headers; None
    for anything else than IHDR first and one run of IDAT chunks before IEND, all inside the file."""
    if view[:8] != _SIGNATURE or view[8:16] != b"\x00\x00\x00\x0dIHDR":
        return None
    place, first, end, parts = 8, None, None, []
    for _ in range(limits.MAX_PNG_CHUNKS):
        if place + 12 > len(view):
            return None
        length, kind = int.from_bytes(view[place:place + 4], "big"), view[place + 4:place + 8]
        after = place + 12 + length
        if after > len(view):
            return None
        if kind == b"IDAT":
            if end is not None:
                return None  # a second run of IDAT chunks
            first = place if first is None else first
            parts.append(view[place + 8:place + 8 + length])
        elif first is not None and end is None:
            end = place
        if kind == b"IEND":
            return (first, end, b"".join(parts)) if parts else None
        place = after
    return None


def _stored(before: memoryview, rows: bytes, after: memoryview) -> bytes:
    """`before`, then `rows` as one zlib stream of stored blocks in IDAT chunks, then `after`: one copy of each."""
    source = memoryview(rows)
    blocks = [source[start:start + _STORED_BLOCK] for start in range(0, len(rows), _STORED_BLOCK)]
    pieces = [before]
    for first in range(0, len(blocks), _BLOCKS_A_CHUNK):
        data = [_ZLIB_HEADER] if first == 0 else []
        for number, block in enumerate(blocks[first:first + _BLOCKS_A_CHUNK], first):
            last = number == len(blocks) - 1
            data += [struct.pack("<BHH", last, len(block), len(block) ^ 0xFFFF), block]  # BFINAL, BTYPE 00: stored
        if first + _BLOCKS_A_CHUNK >= len(blocks):
            data.append(deflate.adler32(rows).to_bytes(4, "big"))
        checksum = deflate.crc32(b"IDAT")
        for piece in data:
            checksum = deflate.crc32(piece, checksum)
        pieces += [sum(map(len, data)).to_bytes(4, "big") + b"IDAT", *data, checksum.to_bytes(4, "big")]
    pieces.append(after)
    return b"".join(pieces)
