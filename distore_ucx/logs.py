"""The library's log lines when the application configured no logging.

Python prints a warning from a library that nobody configured logging for
through its last-resort handler: the message alone, with no time, level,
process or logger ("lost storage node 2 during an insert ...; resending").
The package's logger ("distore_ucx") gets one handler of its own,
`DefaultHandler`, which writes WARNING and above to stderr as the `distore`
command does (time, level, logger[pid]: message), but only while the root
logger has no handler: once the application configures logging
(`logging.basicConfig`, a handler on the root), lines go to its handlers
alone, in its format, never twice. Remove it with
`logging.getLogger("distore_ucx").removeHandler(distore_ucx.logs.HANDLER)`.
"""

from __future__ import annotations

import logging

FORMAT = "%(asctime)s %(levelname)s %(name)s[%(process)d]: %(message)s"


class DefaultHandler(logging.StreamHandler):
    """stderr in FORMAT, WARNING and above, while the root logger has no handler."""

    def __init__(self):
        super().__init__()  # sys.stderr, looked up at each write
        self.setLevel(logging.WARNING)
        self.setFormatter(logging.Formatter(FORMAT))

    def emit(self, record: logging.LogRecord) -> None:
        """Write `record` to stderr, unless the root logger has handlers."""
        if logging.getLogger().handlers:
            return  # the application's handlers have it (the record propagates)
        super().emit(record)


HANDLER = DefaultHandler()


def install() -> None:
    """Give the package's logger the default handler (once; import does it)."""
    package = logging.getLogger("distore_ucx")
    if HANDLER not in package.handlers:
        package.addHandler(HANDLER)
