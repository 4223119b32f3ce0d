"""A GGUF file's metadata, each value checked as it is read.

gguf.py derives a transformers config and a tokenizer from these values; a file that holds garbage
where a count, a number, an array or a token id belongs is refused by a ValueError that names the
file, the key and what it holds, before anything is built. It knows nothing of tensors.
"""

from __future__ import annotations

import math

from chatd.engine.models.quantized.gguf_layout import ARRAY, NUMBER_TYPES, STRING, WHOLE_TYPES


class GGUFMetadata:
    """The key/value metadata of one GGUF file (the gguf library's `reader.fields`), read checked."""

    def __init__(self, fields: dict, file_name: str) -> None:
        self.fields = fields
        self.file_name = file_name

    def __contains__(self, key: str) -> bool:
        return key in self.fields

    def get(self, key: str, default=None):
        """A metadata value (strings and arrays as Python values), or `default` when absent."""
        field = self.fields.get(key)
        return default if field is None else field.contents()

    def invalid(self, problem: str) -> ValueError:
        return ValueError(f"GGUF file {self.file_name}: {problem}")

    def count(self, key: str, default: int | None = None) -> int:
        """A metadata value that counts something: a whole number of at least 1."""
        value = self.get(key, default)
        if value is None:
            raise ValueError(f"GGUF file {self.file_name} lacks the metadata {key}")
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise self.invalid(f"metadata {key} must be a whole number of at least 1, got {value!r}")
        return value

    def positive_number(self, key: str, default: float | None = None) -> float:
        """A metadata value that must be a positive number (an epsilon, a rope base or factor)."""
        value = self.get(key, default)
        if value is None:
            raise ValueError(f"GGUF file {self.file_name} lacks the metadata {key}")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not (math.isfinite(value) and value > 0):
            raise self.invalid(f"metadata {key} must be a positive number, got {value!r}")
        return float(value)

    def array(self, key: str, item_types: tuple[int, ...], items: str) -> list | None:
        """A metadata array whose items are of one of `item_types`, or None when absent."""
        field = self.fields.get(key)
        if field is None:
            return None
        # field.types: [ARRAY] for an empty array, [ARRAY, item type] for a flat one, longer for an array of arrays.
        if field.types[0] != ARRAY or len(field.types) > 2 or (len(field.types) == 2 and field.types[1] not in item_types):
            kind = " of ".join(t.name.lower() for t in field.types)
            raise self.invalid(f"metadata {key} must be an array of {items}, got {kind}")
        return field.contents()

    def num_tokens(self) -> int | None:
        """How many tokens tokenizer.ggml.tokens holds (counted without decoding them), or None."""
        field = self.fields.get("tokenizer.ggml.tokens")
        if field is None:
            return None
        if field.types != [ARRAY, STRING]:
            kind = " of ".join(t.name.lower() for t in field.types)
            raise self.invalid(f"metadata tokenizer.ggml.tokens must be a non-empty array of strings, got {kind}")
        return len(field.data)

    def special_token_ids(self, num_tokens: int) -> dict[str, int | None]:
        """bos_token_id and eos_token_id for the config; every special token id is checked to name a token."""
        for name in ("bos", "eos", "unknown", "padding"):
            key = f"tokenizer.ggml.{name}_token_id"
            value = self.get(key)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < num_tokens):
                raise self.invalid(f"metadata {key} must be a token id from 0 to {num_tokens - 1}, got {value!r}")
        return {"bos_token_id": self.get("tokenizer.ggml.bos_token_id"),
                "eos_token_id": self.get("tokenizer.ggml.eos_token_id")}

    def check_tokenizer(self) -> None:
        """Check what transformers' converter reads, so that garbage is refused by its key."""
        model = self.get("tokenizer.ggml.model")
        if not isinstance(model, str):
            raise self.invalid(f"metadata tokenizer.ggml.model must be a string, got {model!r}")
        num_tokens = self.num_tokens()
        if num_tokens is None:
            raise self.invalid("it has tokenizer.ggml.model but no tokenizer.ggml.tokens")
        for key, item_types, items in (("tokenizer.ggml.scores", NUMBER_TYPES, "numbers"),
                                       ("tokenizer.ggml.token_type", WHOLE_TYPES, "whole numbers")):
            values = self.array(key, item_types, items)
            if values is not None and len(values) != num_tokens:
                raise self.invalid(f"metadata {key} holds {len(values)} values for {num_tokens} tokens")
        for index, merge in enumerate(self.array("tokenizer.ggml.merges", (STRING,), "strings") or ()):
            if len(merge.split(" ")) != 2:
                raise self.invalid(f"metadata tokenizer.ggml.merges[{index}] must be two tokens and a space, got {merge!r}")
        template = self.get("tokenizer.chat_template")
        if template is not None and not isinstance(template, str):
            raise self.invalid(f"metadata tokenizer.chat_template must be a string, got {template!r}")

