"""The one exception type users see: a single line saying what is wrong and what to do."""


class ImgtrainError(Exception):
    """A problem with the user's input or environment.

    The CLI prints ``error: <message>`` on one line and exits with status 2; no traceback.
    Messages name the offending value and say what to do about it.
    """
