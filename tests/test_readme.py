"""The README's settings table is the settings (proxy/settings.py): every FLEETCACHE_* variable
has its row, with its default, and no row names a variable that does not exist."""

from __future__ import annotations

import re
from pathlib import Path

from proxy.settings import Settings

README = Path(__file__).resolve().parents[1] / "README.md"
ROW = re.compile(r"^\| `FLEETCACHE_([A-Z0-9_]+)` \| (.+?) \|", re.MULTILINE)


def settings_rows() -> dict[str, str]:
    table = README.read_text().split("## Settings", 1)[1].split("\n## ", 1)[0]
    return {name.lower(): default for name, default in ROW.findall(table)}


def test_every_setting_has_its_row_and_every_row_a_setting() -> None:
    rows = settings_rows()
    fields = set(Settings.model_fields)
    assert sorted(fields - set(rows)) == [], "settings without a README row"
    assert sorted(set(rows) - fields - {"api_key"}) == [], "rows of no setting"  # CLI-only


def test_the_defaults_shown_are_the_defaults() -> None:
    rows = settings_rows()
    for name, field in Settings.model_fields.items():
        default = field.default
        if default is None or isinstance(default, Path) or name == "model_path":
            continue  # "none", "./data", "the packaged model": words, not values
        shown = rows[name].split()[0].strip("`")
        if isinstance(default, bool):
            value = str(default).lower()
        else:
            value = default if isinstance(default, str) else f"{default:g}"
        assert shown == value, f"FLEETCACHE_{name.upper()}: README says {shown}, default {value}"
