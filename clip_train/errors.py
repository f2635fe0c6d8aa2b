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
    """What a library said when it refused a value, on one line: the message of a ``ValueError`` or
    ``TypeError``, written for its caller; otherwise (a bare ``assert``, a division by zero) the
    line that raised and where it stands, after the message if there is one."""
    message = " ".join(str(err).split())
    if message and isinstance(err, (ValueError, TypeError)):
        return message
    frame = traceback.extract_tb(err.__traceback__)[-1]
    where = f"{frame.line} ({Path(frame.filename).name}:{frame.lineno})"
    return f"{message}: {where}" if message else where
