"""The operators' dashboard page: one self-contained HTML file that polls ``/v1/stats``.

No external assets (no CDN): the page, its CSS and its JavaScript ship in ``proxy/static``.
"""

from __future__ import annotations

import functools
from importlib import resources


@functools.cache
def dashboard_html() -> str:
    return resources.files("proxy").joinpath("static/dashboard.html").read_text(encoding="utf-8")
