"""The one exception type users see: a single line saying what is wrong and what to do."""


class ImgtrainError(Exception):
    """A problem with the user's input or environment.

    The CLI prints ``error: <message>`` on one line and exits with status 2; no traceback.
    Messages name the offending value and say what to do about it.
    """


class ImgtrainWarning(UserWarning):
    """Something the user should know that does not stop the command (a damaged checkpoint
    passed over, say). The library issues it with ``warnings.warn``; the CLI prints it as one
    line, ``warning: ...``, on stderr."""


def one_line(error: BaseException | str, limit: int = 300) -> str:
    """An exception's message (or any text) squeezed onto one line: pyarrow's and Ray's span several."""
    return " ".join(str(error).split())[:limit]
