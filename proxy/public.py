"""What an answer may say of the server's internals (API.md: error messages carry no absolute
paths and no internal exception text). The full text stays in the log and ``/v1/stats``
(operators)."""

from __future__ import annotations

import functools
import re
from pathlib import Path

_PATH = re.compile(r"(?:/[^/\s'\"]+)+/?")
# an exception's text inside a reason, as the engines write it: ``RuntimeError: ...`` or
# ``RuntimeError('...')``, to the end
_EXCEPTION = re.compile(r"\b[A-Z]\w*(?:Error|Exception)(?::\s|\().*", re.DOTALL)


def cut_paths(text: str) -> str:
    """``text`` with each absolute path (``/a/b/c.h:583``) cut to its last part (``c.h:583``)."""
    return _PATH.sub(lambda m: Path(m.group()).name, text)


@functools.cache  # the engine's one model, asked by every answer
def public_model(model: str) -> str:
    """The model as a dispatch client's answer names it: a model directory by its name, not
    where it lies on the server (``/v1/stats``, for operators, keeps the path); the packaged
    model's directory, ``model`` inside its package, by the package's name."""
    path = Path(model)
    if not path.is_absolute():
        return model
    return path.parent.name if path.name == "model" and path.parent.name else path.name


def public_reason(reason: str) -> str:
    """``reason`` as an error answer may give it: an exception's text in it, from its class
    name on, replaced by a pointer to the log, and each absolute path cut."""
    return cut_paths(_EXCEPTION.sub("an error (its text is in the server log)", reason))


def public_error(exc: BaseException) -> str:
    """What a warm-up job's ``error`` may say: the exception's kind and message (a bad row,
    an unreadable file: the job's own input), each absolute path cut to its file name."""
    message = cut_paths(str(exc))
    return f"{type(exc).__name__}: {message}" if message else type(exc).__name__
