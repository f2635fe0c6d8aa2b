"""The one exception family the CLI reports as a plain message instead of a traceback."""


class UserError(Exception):
    """An expected failure (bad config, path, data or weights; a diverged run) whose message says
    what to change."""
