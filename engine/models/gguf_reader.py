"""A GGUF reader for loading: the tensors and the scalar metadata, not the arrays.

``gguf.GGUFReader`` builds every metadata value as numpy views of the mapped file, one per
array element: a 151,936-token vocabulary plus its 151,387 merges is 455,000 views, seconds of
every load before a single weight converts (docs/bench/README.md, First load of a GGUF file). A
load reads the architecture, a few scalars and the tensors; the vocabulary and chat template
are read once, by transformers, when ``prepare`` makes the model's folder. So here an array
value is stepped over (its element lengths read with ``struct``) and recorded in ``skipped``
instead of ``fields``; everything else, the tensors included, is the library's own parsing.

Depends on ``GGUFReader._build_fields`` (gguf 0.19: called once from ``__init__`` with the
offset of the first key/value and their count, returns the offset after the last). A bad file
still fails in the constructor: a length that runs past the end raises ``struct.error``.
"""

from __future__ import annotations

import struct

import gguf
from gguf.constants import GGUFEndian, GGUFValueType

# GGUF scalar value types -> bytes (the string type is a uint64 length then the bytes)
_SIZES = {GGUFValueType.UINT8: 1, GGUFValueType.INT8: 1, GGUFValueType.BOOL: 1,
          GGUFValueType.UINT16: 2, GGUFValueType.INT16: 2,
          GGUFValueType.UINT32: 4, GGUFValueType.INT32: 4, GGUFValueType.FLOAT32: 4,
          GGUFValueType.UINT64: 8, GGUFValueType.INT64: 8, GGUFValueType.FLOAT64: 8}


class TensorReader(gguf.GGUFReader):
    """``GGUFReader`` with array-valued metadata skipped (module docstring): ``fields`` holds the
    scalars and strings, ``skipped`` the names of the arrays."""

    def _build_fields(self, offs: int, count: int) -> int:
        self.skipped: set[str] = set()
        view = memoryview(self.data)
        order = "<" if self.endianess == GGUFEndian.LITTLE else ">"
        for _ in range(int(count)):
            (klen,) = struct.unpack_from(order + "Q", view, offs)
            name = bytes(view[offs + 8:offs + 8 + klen]).decode("utf-8")
            (vtype,) = struct.unpack_from(order + "I", view, offs + 8 + klen)
            if vtype != GGUFValueType.ARRAY:  # one scalar or string: the library parses it
                offs = super()._build_fields(offs, 1)
                continue
            self.skipped.add(name)
            offs = _skip_array(view, offs + 12 + klen, order)
        return offs


def _skip_array(view: memoryview, offs: int, order: str) -> int:
    """The offset after the array value at ``offs`` (its element type, count, elements)."""
    itype, n = struct.unpack_from(order + "IQ", view, offs)
    offs += 12
    if itype == GGUFValueType.STRING:
        for _ in range(n):
            (slen,) = struct.unpack_from(order + "Q", view, offs)
            offs += 8 + slen
    elif itype == GGUFValueType.ARRAY:
        for _ in range(n):
            offs = _skip_array(view, offs, order)
    elif itype in _SIZES:
        offs += n * _SIZES[GGUFValueType(itype)]
    else:
        raise ValueError(f"unknown GGUF array element type {itype}")
    if offs > len(view):
        raise ValueError(f"an array runs past the end of the file (byte {offs:,} of {len(view):,})")
    return offs

