"""Argument types the `chatd` commands share: argparse calls each on a flag's text and turns the
ArgumentTypeError it raises into a usage error naming the flag."""

from __future__ import annotations

import argparse


def non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
    if not value >= 0:  # (NaN too)
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {text}")
    return value


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def positive_number(kind: type):
    """A type that reads `kind` (int or float) and takes only values above 0."""
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a {'whole ' if kind is int else ''}number, got {text!r}") from None
        if not value > 0:  # NaN too
            raise argparse.ArgumentTypeError(f"must be more than 0, got {text}")
        return value
    return parse
