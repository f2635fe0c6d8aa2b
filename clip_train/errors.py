"""The one exception family the CLI reports as a plain message instead of a traceback."""

from collections.abc import Iterator
from contextlib import contextmanager


class UserError(Exception):
    """An expected failure (bad config, path, data or weights; a diverged run) whose message says
    what to change."""


@contextmanager
def naming_key(key: str, value: str) -> Iterator[None]:
    """Prefix ``key=value`` to a ``UserError`` from a helper that does not know which key it was given."""
    try:
        yield
    except UserError as err:
        raise UserError(f"{key}={value}: {err}") from None
