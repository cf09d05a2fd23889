"""The base of every error whose message says what went wrong and what to do."""


class UserError(Exception):
    """A known failure (bad input, cluster, data, storage): shown without a traceback."""
