"""What an answer may say of the server's internals (API.md: error messages carry no absolute
paths): the text of an exception with every absolute path cut to its file name."""

from __future__ import annotations

import re
from pathlib import Path

_PATH = re.compile(r"(?:/[^/\s'\"]+)+/?")


def cut_paths(text: str) -> str:
    """``text`` with each absolute path (``/a/b/c.h:583``) cut to its last part (``c.h:583``)."""
    return _PATH.sub(lambda m: Path(m.group()).name, text)
