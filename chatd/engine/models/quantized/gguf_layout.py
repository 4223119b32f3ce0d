"""A GGUF file's structure, checked against its size before the gguf library reads it.

The gguf library trusts every length, count and offset a file states: a cut or corrupt file gives
an IndexError, numpy's wording, or a loop over 2^40 items. `check_layout` walks the file front to
back first: the magic and version, each metadata key and value (type codes, string lengths, array
counts, general.alignment), each tensor's entry (name, dimensions, ggml type, offset), and that
each tensor's data lies inside the file. A file that breaks any of them is refused by a ValueError
that names the file and says what it was reading when the bytes ran out or stopped making sense.

It reads the header, the metadata and the tensor table only, never tensor data (it compares where
the data would end with the file's size), and knows nothing of models, configs or torch: what the
metadata says and whether the tensors make a model is gguf.py's to check.
"""

from __future__ import annotations

import math
import mmap
import os
import struct
from pathlib import Path

# GGUF's metadata value types (gguf.GGUFValueType's codes; the library is imported only to read a
# file). The fixed-size ones, with their size in bytes: uint8, int8, uint16, int16, uint32, int32,
# float32, bool, and (10-12) uint64, int64, float64.
FIXED_VALUE_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
UINT32 = 4
STRING = 8  # a uint64 length, then UTF-8
ARRAY = 9  # an item type, a uint64 count, then the items
WHOLE_TYPES = (0, 1, 2, 3, 4, 5, 10, 11)  # the integer types
NUMBER_TYPES = (*WHOLE_TYPES, 6, 12)  # and the float types

GGUF_VERSIONS = (2, 3)  # what the gguf library reads
MAX_DIMS = 4  # ggml's GGML_MAX_DIMS
DEFAULT_ALIGNMENT = 32  # where tensor data starts when general.alignment is absent


def shown(text: str) -> str:
    """A key or tensor name read from a file as a one-line message shows it: cut to 60 characters,
    and quoted when it holds anything unprintable (a newline in it would break the line)."""
    cut = text if len(text) <= 60 else text[:60] + "..."
    return cut if cut.isprintable() else repr(cut)


def check_layout(path: Path) -> None:
    """Check a GGUF file's header, metadata and tensor table against its size before the gguf
    library reads it: every length, count, type code and offset. Reads no tensor data; a ValueError
    names the file and what is wrong, an OSError says the file could not be opened."""
    with path.open("rb") as file:
        if os.fstat(file.fileno()).st_size == 0:  # mmap refuses an empty file in its own words
            raise ValueError(f"{path} is not a readable GGUF file: it is empty")
        with mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as data:
            cursor = _LayoutCursor(data, path)
            num_tensors, num_fields = cursor.header()
            alignment = cursor.metadata(num_fields)
            tensors = cursor.tensor_table(num_tensors)
            cursor.check_tensor_data(tensors, alignment)


class _LayoutCursor:
    """A position in a GGUF file's bytes, moved front to back, that says what it was reading when they ran out."""

    def __init__(self, data: mmap.mmap, path: Path) -> None:
        self.data, self.path = data, path
        self.size = len(data)
        self.pos = 0
        self.byte_order = "<"  # ">" for a file written on a big-endian machine

    def unreadable(self, problem: str) -> ValueError:
        return ValueError(f"{self.path} is not a readable GGUF file: {problem}")

    def skip(self, num_bytes: int, what: str) -> int:
        """Step over `num_bytes` bytes of `what`; where they start."""
        if num_bytes > self.size - self.pos:
            raise self.unreadable(f"it ends after {self.size} bytes, inside {what}")
        self.pos += num_bytes
        return self.pos - num_bytes

    def read(self, fmt: str, what: str) -> tuple:
        """Unpack the struct `fmt` (in the file's byte order) at the cursor and step over it."""
        fmt = self.byte_order + fmt
        return struct.unpack_from(fmt, self.data, self.skip(struct.calcsize(fmt), what))

    def read_string(self, what: str) -> str:
        (length,) = self.read("Q", what)
        start = self.skip(length, f"{what} (a string of {length} bytes)")
        try:
            return str(self.data[start : self.pos], "utf-8")
        except UnicodeDecodeError:
            raise self.unreadable(f"{what} is not UTF-8 text") from None

    def skip_value(self, value_type: int, what: str) -> None:
        if value_type in FIXED_VALUE_BYTES:
            self.skip(FIXED_VALUE_BYTES[value_type], what)
        elif value_type == STRING:
            self.read_string(what)
        elif value_type == ARRAY:
            item_type, count = self.read("IQ", what)
            if item_type in FIXED_VALUE_BYTES:  # measured whole: a count of 2^40 costs nothing
                self.skip(count * FIXED_VALUE_BYTES[item_type], f"{what} (an array of {count} values)")
            elif item_type in (STRING, ARRAY):
                for _ in range(count):  # each item takes 8 bytes or more, so a false count soon runs out of file
                    self.skip_value(item_type, f"{what} (an array of {count} values)")
            else:
                raise self.unreadable(f"{what} is an array of unknown value type {item_type}")
        else:
            raise self.unreadable(f"{what} has an unknown value type {value_type}")

    def header(self) -> tuple[int, int]:
        """Check the magic and the version; (number of tensors, number of metadata entries)."""
        magic = bytes(self.data[:4])
        if not b"GGUF".startswith(magic):  # a file cut inside the magic is told as cut, below
            raise self.unreadable(f"it does not start with GGUF's magic bytes b'GGUF' but with {magic!r}")
        self.skip(4, "its header")
        (version,) = self.read("I", "its header")
        if version & 0xFFFF == 0:  # a small number read in the wrong byte order: the gguf library's test for big-endian
            self.byte_order, version = ">", int.from_bytes(version.to_bytes(4, "little"), "big")
        if version not in GGUF_VERSIONS:
            raise self.unreadable(f"it is GGUF version {version}; chatd reads versions {' and '.join(map(str, GGUF_VERSIONS))}")
        return self.read("QQ", "its header")

    def metadata(self, num_fields: int) -> int:
        """Step over every metadata entry; the file's alignment of tensor data."""
        keys, alignment = set(), DEFAULT_ALIGNMENT
        for index in range(num_fields):
            key = self.read_string(f"the key of metadata entry {index + 1} of {num_fields}")
            if key in keys:
                raise self.unreadable(f"metadata {shown(key)} appears twice")
            keys.add(key)
            (value_type,) = self.read("I", f"metadata {shown(key)}")
            if key != "general.alignment":
                self.skip_value(value_type, f"metadata {shown(key)}")
                continue
            # It places every tensor's data, so it must be sound before anything is read by it.
            if value_type == UINT32:
                (alignment,) = self.read("I", f"metadata {key}")
            if value_type != UINT32 or alignment == 0 or alignment & (alignment - 1):
                raise self.unreadable("metadata general.alignment must be a uint32 power of two")
        return alignment

    def tensor_table(self, num_tensors: int) -> list[tuple[int, str, tuple[int, ...], int]]:
        """Step over every tensor's entry; (offset, name, shape, size in bytes) of each."""
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        tensors, names = [], set()
        for index in range(num_tensors):
            name = self.read_string(f"the name of tensor {index + 1} of {num_tensors}")
            tensor = f"tensor {index + 1} of {num_tensors} ({shown(name) or 'no name'})"
            (num_dims,) = self.read("I", f"the shape of {tensor}")
            if not 1 <= num_dims <= MAX_DIMS:
                raise self.unreadable(f"{tensor} has {num_dims} dimensions; GGUF allows 1 to {MAX_DIMS}")
            shape = self.read(f"{num_dims}Q", f"the shape of {tensor}")  # columns first
            type_code, offset = self.read("IQ", f"the type and offset of {tensor}")
            if name in names:
                raise self.unreadable(f"{tensor} has the name of an earlier one")
            names.add(name)
            try:
                ggml_type = GGMLQuantizationType(type_code)
                block, block_bytes = GGML_QUANT_SIZES[ggml_type]
            except (ValueError, KeyError):
                raise self.unreadable(f"{tensor} has unknown ggml type {type_code}") from None
            if shape[0] % block:
                raise self.unreadable(f"{tensor}'s rows of {shape[0]} values are not whole {ggml_type.name} blocks of {block}")
            tensors.append((offset, name, shape, math.prod(shape) // block * block_bytes))
        return tensors

    def check_tensor_data(self, tensors: list[tuple[int, str, tuple[int, ...], int]], alignment: int) -> None:
        """Check that each tensor's data, after the tensor table, ends inside the file."""
        data_start = -(-self.pos // alignment) * alignment  # the table's end, rounded up to the alignment
        for offset, name, shape, num_bytes in sorted(tensors):  # by offset: a cut file names the tensor it cuts
            start, end = data_start + offset, data_start + offset + num_bytes
            if end <= self.size:
                continue
            if start >= self.size:
                raise self.unreadable(f"the data of tensor {shown(name)} starts at byte {start}, past its end ({self.size} bytes)")
            if num_bytes > self.size:
                raise self.unreadable(f"tensor {shown(name)}'s shape {list(shape)} needs {num_bytes} bytes, more than the "
                                      f"whole file ({self.size} bytes)")
            raise self.unreadable(f"it ends after {self.size} bytes, inside the data of tensor {shown(name)} "
                                  f"(bytes {start} to {end})")
