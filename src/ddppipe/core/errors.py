"""The base of every error whose message says what went wrong and what to do, and an error
in one line."""


class UserError(Exception):
    """A known failure (bad input, cluster, data, storage): shown without a traceback."""


def one_line(e: BaseException) -> str:
    """``e`` as its type and its message's first line (a warning that something went off)."""
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"
