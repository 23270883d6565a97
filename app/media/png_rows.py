"""A PNG whose compressed rows are inflated by libdeflate and handed on stored, for libspng to unfilter.

libspng inflates a PNG's rows with zlib, about 16 of its 18-19 ms for the benchmark's 1344x1344 noise PNG on a
dev core; libdeflate inflates the same stream in 10. `with_rows_stored` gives the same PNG with its IDAT chunks
replaced by one holding those rows in stored (uncompressed) deflate blocks: libspng then only copies them
and undoes the rows' filters, and gives the same pixels (docs/DECISIONS.md D58).
"""

import struct

import deflate

from app import limits
from app.media.files import PNG_SIGNATURE

_CHANNELS = {0: 1, 2: 3, 3: 1, 4: 2, 6: 4}  # by IHDR's colour type
_STORED_BLOCK = 65535  # the most a stored deflate block holds
# The most rows taken (a 4,600x4,600 RGB image): libspng is then handed them whole, where a compressible PNG was
# a fraction of their size; past it the PNG goes to libspng as it is (docs/DECISIONS.md D58).
MAX_ROWS_BYTES = 64 * 2**20
_FIRST_CHUNK_AFTER_IHDR = 8 + 12 + 13  # the signature, then IHDR: its length, type and checksum, its 13 bytes
_ZLIB_HEADER = b"\x78\x01"  # deflate, a 32 KB window, no dictionary (a multiple of 31, as zlib requires)


def with_rows_stored(data: bytes) -> bytes | None:
    """`data`, a PNG, with its rows inflated and stored; None where libspng should take it as it is: not a PNG
    laid out as expected (IHDR first, one run of IDAT chunks, IEND), interlaced, with rows past MAX_ROWS_BYTES, or
    with a stream that does not inflate, checksum and all, to exactly its rows' size (libspng then refuses it, or
    decodes what it can)."""
    if data[:8] != PNG_SIGNATURE or data[8:16] != b"\x00\x00\x00\x0dIHDR" or len(data) < _FIRST_CHUNK_AFTER_IHDR:
        return None
    width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
    bit_depth, colour_type, interlaced = data[24], data[25], data[28]
    if interlaced or colour_type not in _CHANNELS:
        return None
    size = height * (1 + -(-width * _CHANNELS[colour_type] * bit_depth // 8))
    layout = _idat_run(memoryview(data)) if size <= MAX_ROWS_BYTES else None
    if layout is None:
        return None
    first, end, compressed = layout
    del layout  # the compressed rows go once inflated
    try:
        rows = deflate.zlib_decompress(compressed, size)
    except deflate.DeflateError:
        return None
    del compressed
    if len(rows) != size:  # fewer rows than the header says (libdeflate refuses more)
        return None
    return _stored(memoryview(data)[:first], rows, memoryview(data)[end:])


def _idat_run(view: memoryview) -> tuple[int, int, bytes] | None:
    """(where the IDAT chunks start, where they end, their data joined), walking the chunks' headers after IHDR;
    None for anything else than one run of IDAT chunks before IEND, all inside the file."""
    place, first, end, parts = _FIRST_CHUNK_AFTER_IHDR, None, None, []
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
    """`before`, then `rows` as one zlib stream of stored blocks in one IDAT chunk, then `after`: one copy of each."""
    source = memoryview(rows)
    data = [_ZLIB_HEADER]
    for start in range(0, len(rows), _STORED_BLOCK):
        block = source[start:start + _STORED_BLOCK]
        last = start + _STORED_BLOCK >= len(rows)
        data += [struct.pack("<BHH", last, len(block), len(block) ^ 0xFFFF), block]  # BFINAL, BTYPE 00: stored
    data.append(deflate.adler32(rows).to_bytes(4, "big"))
    checksum = deflate.crc32(b"IDAT")
    for piece in data:
        checksum = deflate.crc32(piece, checksum)
    return b"".join([before, sum(map(len, data)).to_bytes(4, "big") + b"IDAT", *data, checksum.to_bytes(4, "big"),
                     after])
