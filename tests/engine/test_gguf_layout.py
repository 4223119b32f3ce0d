"""A GGUF file's structure (gguf_layout.check_layout): a sound file passes; a cut or corrupt one
(false counts, lengths, type codes, shapes or offsets) is refused before the gguf library reads
it, by one line that names the file and what was being read, which `chatd generate` and `chatd
serve` print before exiting 2; and bytes flipped at random in the header, the metadata or the
tensor table give a file that loads or is refused by name, never any other error.
"""

from __future__ import annotations

import random
import struct
from pathlib import Path

import gguf
import pytest

from chatd.engine.models.quantized.gguf_layout import check_layout
from tests.engine.conftest import make_llm
from tests.engine.test_gguf import (LOG_LINE, chatd_generate, chatd_home, chatd_process,  # noqa: F401 (fixtures)
                                    generate_prints_one_line, sound_gguf)


def offsets(path: Path) -> dict[str, int]:
    """Where in a GGUF file the corrupt copies change it (the gguf library's reader says where each part is)."""
    reader = gguf.GGUFReader(path)
    first, last = reader.tensors[0].field, reader.tensors[-1].field
    arch = reader.fields["general.architecture"]

    def after_shape(field) -> int:  # a tensor entry: name length, name, dimension count, shape, type, offset
        return field.offset + 8 + len(field.name.encode()) + 4 + 8 * int(field.parts[2][0])

    return {
        "num_tensors": len(reader.tensors),
        "in_metadata": reader.fields["tokenizer.ggml.tokens"].offset + 100,
        "in_tensor_table": reader.tensors[3].field.offset + 5,
        "arch_type": arch.offset + 8 + len(arch.name),
        "arch_length": arch.offset + 8 + len(arch.name) + 4,
        "num_dims": first.offset + 8 + len(first.name.encode()),
        "first_dim": first.offset + 8 + len(first.name.encode()) + 4,
        "ggml_type": after_shape(first),
        "last_offset": after_shape(last) + 4,
        "data": reader.data_offset,
    }


def patched(data: bytes, at: int, fmt: str, value) -> bytes:
    out = bytearray(data)
    struct.pack_into(fmt, out, at, value)
    return bytes(out)


# Copies of the sound file (test_gguf.write_sound: 21 metadata entries, 21 tensors) with its bytes
# changed: (what is done, what the message must say).
BROKEN_BYTES = {
    "empty": (lambda d, at: b"", "it is empty"),
    "four_bytes": (lambda d, at: d[:4], "it ends after 4 bytes, inside its header"),
    "cut_to_24_bytes": (lambda d, at: d[:24], "it ends after 24 bytes, inside the key of metadata entry 1 of "),
    "cut_in_metadata": (lambda d, at: d[:at["in_metadata"]], "inside metadata tokenizer.ggml.tokens"),
    "cut_in_tensor_table": (lambda d, at: d[:at["in_tensor_table"]], "inside the name of tensor 4 of "),
    "cut_in_tensor_data": (lambda d, at: d[:(at["data"] + len(d)) // 2], "inside the data of tensor "),
    "wrong_magic": (lambda d, at: b"GGML" + d[4:], "does not start with GGUF's magic bytes b'GGUF' but with b'GGML'"),
    "version_7": (lambda d, at: patched(d, 4, "<I", 7), "it is GGUF version 7; chatd reads versions 2 and 3"),
    "metadata_count_2^40": (lambda d, at: patched(d, 16, "<Q", 2**40), " of 1099511627776"),
    "one_tensor_too_many": (lambda d, at: patched(d, 8, "<Q", at["num_tensors"] + 1), "tensor 22 of 22 (no name)"),
    "tensor_count_2^40": (lambda d, at: patched(d, 8, "<Q", 2**40), " of 1099511627776"),
    "200_dimensions": (lambda d, at: patched(d, at["num_dims"], "<I", 200),
                       "tensor 1 of 21 (token_embd.weight) has 200 dimensions; GGUF allows 1 to 4"),
    "dimension_2^40": (lambda d, at: patched(d, at["first_dim"], "<Q", 2**40), "more than the whole file"),
    "unknown_ggml_type": (lambda d, at: patched(d, at["ggml_type"], "<I", 99),
                          "tensor 1 of 21 (token_embd.weight) has unknown ggml type 99"),
    "offset_past_the_end": (lambda d, at: patched(d, at["last_offset"], "<Q", len(d)), "past its end"),
    "string_length_past_the_end": (lambda d, at: patched(d, at["arch_length"], "<Q", 2**40),
                                   "inside metadata general.architecture (a string of 1099511627776 bytes)"),
    "unknown_value_type": (lambda d, at: patched(d, at["arch_type"], "<I", 99),
                           "metadata general.architecture has an unknown value type 99"),
    "key_not_utf8": (lambda d, at: patched(d, 24 + 8, "<B", 0xFF), "the key of metadata entry 1 of 21 is not UTF-8 text"),
}


def broken_copy(case: str, sound: Path, folder: Path) -> tuple[Path, str]:
    """The corpus file of a BROKEN_BYTES case, and what its message must say."""
    edit, says = BROKEN_BYTES[case]
    path = folder / f"{case}.gguf"
    path.write_bytes(edit(sound.read_bytes(), offsets(sound)))
    return path, says


def test_the_sound_file_passes(sound_gguf):
    check_layout(sound_gguf)


@pytest.mark.parametrize("case", BROKEN_BYTES)
def test_a_corrupt_file_is_refused_by_one_line_that_chatd_generate_prints(case, sound_gguf, tmp_path, chatd_home, capsys):
    path, says = broken_copy(case, sound_gguf, tmp_path)
    with pytest.raises(ValueError) as refused:
        check_layout(path)
    message = str(refused.value)
    assert message.startswith(f"{path} is not a readable GGUF file: ") and says in message
    assert chatd_generate(path, capsys) == (2, [f"chatd: {message}"])


@pytest.mark.slow
def test_chatd_generate_on_a_cut_file_prints_only_that_line(sound_gguf, tmp_path):
    path, says = broken_copy("cut_to_24_bytes", sound_gguf, tmp_path)
    line = generate_prints_one_line(path, tmp_path / "home")
    assert line.startswith(f"chatd: {path} is not a readable GGUF file: ") and says in line


@pytest.mark.slow
def test_chatd_serve_on_a_file_claiming_2_to_the_40_tensors_exits_2_with_one_line(sound_gguf, tmp_path):
    path, says = broken_copy("tensor_count_2^40", sound_gguf, tmp_path)
    done = chatd_process("serve", "--model", str(path), "--device", "cpu", "--port", "0", home=tmp_path / "home")
    assert done.returncode == 2, done.stderr
    [line] = [line for line in done.stderr.splitlines() if not LOG_LINE.match(line)]
    assert line.startswith(f"chatd: {path} is not a readable GGUF file: ") and says in line


def test_flipped_header_bytes_load_or_are_refused_by_name(sound_gguf, tmp_path, chatd_home):
    """50 copies with 1 to 3 bytes flipped in one header, metadata or tensor-table entry (seeded):
    each loads, or raises a ValueError that names its file; never anything else."""
    data = sound_gguf.read_bytes()
    reader = gguf.GGUFReader(sound_gguf)
    entries = [field for field in reader.fields.values()] + [tensor.field for tensor in reader.tensors]
    spans = [(f.offset, f.offset + sum(int(part.nbytes) for part in f.parts)) for f in entries]
    rng = random.Random(36)
    refused = 0
    for variant in range(50):
        start, end = rng.choice(spans)
        flipped = bytearray(data)
        for _ in range(rng.randint(1, 3)):
            flipped[rng.randrange(start, min(end, start + 64))] ^= rng.randrange(1, 256)
        path = tmp_path / f"flipped-{variant}.gguf"
        path.write_bytes(bytes(flipped))
        try:
            make_llm(path)
        except ValueError as exc:
            assert path.name in str(exc), f"variant {variant}: {exc}"
            refused += 1
    assert refused >= 25  # most flips in lengths, counts and types break the file
