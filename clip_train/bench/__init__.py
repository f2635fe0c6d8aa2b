"""Benchmarks behind `clip-train bench …`: command modules outside the library (nothing in it imports
them). Each measurement runs in a fresh process (``runner``), so its memory peak is its own."""

from clip_train.errors import UserError


def positive_ints(text: str, flag: str) -> list[int]:
    """A flag's comma-separated sizes (``--batch 256,1024``), or a one-line error naming the flag."""
    try:
        values = [int(part) for part in text.split(",")]
    except ValueError:
        values = []
    if not values or min(values) <= 0:
        raise UserError(f"{flag} {text!r} must be comma-separated positive integers, e.g. 256,1024")
    return values
