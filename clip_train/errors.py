"""The one exception family the CLI reports as a plain message instead of a traceback."""

import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


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


def refusal(err: BaseException) -> str:
    """What a library said when it refused a value, on one line: its message, or for a bare
    ``assert`` the asserted line and where it stands."""
    if message := " ".join(str(err).split()):
        return message
    frame = traceback.extract_tb(err.__traceback__)[-1]
    return f"{frame.line} ({Path(frame.filename).name}:{frame.lineno})"
