"""The one exception family the CLI reports as a plain message instead of a traceback."""


class UserError(Exception):
    """Bad input from the user (config, paths, data, weights): the message says what to change."""
