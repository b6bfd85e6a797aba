"""vitkit's own error types, in the lowest module so every reader can raise them and every test can catch them.

Both are `ValueError`s, so code that already catches `ValueError` (the CLI's exit status 2) keeps working.
"""

from __future__ import annotations

import contextlib
import difflib
import os
from collections.abc import Iterable, Iterator
from contextvars import ContextVar
from typing import TypeVar

T = TypeVar("T")

_COMMAND: ContextVar[str | None] = ContextVar("vitkit_command", default=None)


@contextlib.contextmanager
def from_command(command: str) -> Iterator[None]:
    """Mark what runs inside as the `vitkit COMMAND` sub-command, so errors name its options (`spelled`)."""
    token = _COMMAND.set(command)
    try:
        yield
    finally:
        _COMMAND.reset(token)


def is_ctrl_c(e: BaseException) -> bool:
    """Whether `e` is a Ctrl-C: a KeyboardInterrupt, or one wrapped in a RuntimeError on its way up (Python 3.11
    re-raises what a class body's `__set_name__` raises as a RuntimeError from it, and torch imports its compiler
    lazily in such a body)."""
    wrapped = isinstance(e, RuntimeError) and isinstance(e.__cause__, KeyboardInterrupt)
    return isinstance(e, KeyboardInterrupt) or wrapped


def running_command() -> str | None:
    """The `vitkit` sub-command being run, or None when the library is called from Python."""
    return _COMMAND.get()


def spelled(argument: str, option: str) -> str:
    """The fix an error names, as the caller gives it: the library's `argument` (`overwrite=True`), or from the
    command line its `option` (`--overwrite`)."""
    return argument if _COMMAND.get() is None else option


def did_you_mean(name: str, choices: Iterable[str]) -> str:
    """The hint after a misspelt `name`: " (did you mean 'x'?)" with the closest of `choices`, or "" where none is."""
    close = difflib.get_close_matches(name, list(choices), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


class CheckpointError(ValueError):
    """A checkpoint file (any format) that cannot be read as a model: truncated, inconsistent, hostile, or with
    non-finite weights. The message names the file and, where there is one, the key."""

    def __init__(self, path: str | os.PathLike, message: str, key: str | None = None):
        self.path, self.key, self.reason = str(path), key, message
        where = f"{path}" + (f" [{key}]" if key is not None else "")
        super().__init__(f"{where}: {message}")

    def __reduce__(self):  # picklable, so it crosses from DataLoader workers intact
        return type(self), (self.path, self.reason, self.key)


class ImageError(ValueError):
    """An image file that cannot be used: not an image, truncated, empty, or too large to decode safely."""

    def __init__(self, path: str | os.PathLike, message: str):
        self.path, self.reason = str(path), message
        super().__init__(f"{path}: {message}")

    def __reduce__(self):
        return type(self), (self.path, self.reason)


class WorkerError(RuntimeError):
    """A DataLoader worker process died (killed, out of memory): reported at once instead of waited on."""


def reporting_dead_workers(batches: Iterable[T]) -> Iterator[T]:
    """The batches of a DataLoader, with the death of one of its worker processes raised as a WorkerError that
    says what to do (torch's own RuntimeError names only the worker)."""
    try:
        yield from batches
    except RuntimeError as e:
        if "DataLoader worker" not in str(e):
            raise
        raise WorkerError(
            f"a data-loading worker process died ({e}). If memory ran out, lower --workers; --workers 0 decodes "
            "in the main process, where an error names its file."
        ) from e


class NonFiniteError(RuntimeError):
    """Training met a NaN or infinite loss or gradient and stopped; the last checkpoint is the last good state."""
