"""The errors behind an error: what a library's own error was raised from, or while handling.

Libraries turn the exceptions they meet into their own: torch's writer reports a Ctrl-C raised
inside a Python file's ``write`` as a failed write, and Python reports one raised inside a
class's ``__set_name__`` (torch's dataclasses, while torch imports) as a ``RuntimeError``. What
stopped the work is then found behind the error, not in its type.
"""

from __future__ import annotations

from collections.abc import Iterator


def error_chain(err: BaseException | None) -> Iterator[BaseException]:
    """``err`` and the errors behind it (``__cause__``, else ``__context__``)."""
    while err is not None:
        yield err
        err = err.__cause__ or err.__context__


def stop_behind(err: BaseException | None) -> KeyboardInterrupt | None:
    """The Ctrl-C or SIGTERM (``runtime.signals.Terminated``) behind ``err``, itself included, or None."""
    return next((e for e in error_chain(err) if isinstance(e, KeyboardInterrupt)), None)
