"""The terminal: rich consoles that show text read from files and object stores as text.

A run's status.json, config.json or metrics come from whoever could write its folder or
bucket; printed as they are, ``\\x1b[2J`` clears the user's screen, ``\\x1b]0;...`` retitles the
window and ``\\x1b]8;;URL`` plants a hyperlink. Every console imgtrain prints with shows such
characters as escapes instead, whatever the text (markup and highlighting are off as well: a
``[link=...]`` in a class name stays text).
"""

from __future__ import annotations

import re

from rich.console import Console

# C0 controls but newline and tab, DEL, C1 controls, and the Unicode marks that reorder or hide
# what a reader sees (bidirectional overrides and isolates, "Trojan Source")
_UNPRINTABLE = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u200e\u200f\u202a-\u202e\u2066-\u2069]")


def printable(text: str) -> str:
    """``text`` with every control character written as its escape (``\\x1b``)."""
    return _UNPRINTABLE.sub(lambda m: f"\\x{ord(m[0]):02x}" if ord(m[0]) < 256 else f"\\u{ord(m[0]):04x}", text)


class SafeConsole(Console):
    """A rich Console that prints strings through ``printable`` (cells of a table too: rich
    renders every string through ``render_str``)."""

    def __init__(self, **kwargs):
        kwargs.setdefault("markup", False)
        kwargs.setdefault("highlight", False)
        super().__init__(**kwargs)

    def render_str(self, text: str, **kwargs):
        return super().render_str(printable(text), **kwargs)


# The one console on stderr: a line a module prints while the command's progress bar is live
# (prepare's, while a source is copied) goes above the bar, not into it. Its lines, and those of
# the CLI's console on stdout, are never cut at the console's width (80 columns off a terminal):
# a path or a message stays one line that a script can read and a user can copy.
err_console = SafeConsole(stderr=True, soft_wrap=True)
