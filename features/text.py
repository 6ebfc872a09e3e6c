"""Canonical feature text: what the engine embeds for a driver, a vehicle or an order.

The text is the cache key (after the engine fingerprint namespace), so it must be
deterministic and must change only when a slowly-changing feature really changes. It renders
the vehicle and the profile; it leaves out everything that moves or is an identity:

* ``position``, ``status`` and timestamps are never rendered (API.md: a position update never
  costs an inference);
* ``driver_id`` and ``vehicle_id`` are never rendered: an id carries no semantic signal for the
  model, and it would make every driver's text unique, so two drivers with identical vehicles
  and profiles could never share a cached vector;
* for an order, ``order_id``, the pickup point and time, ``radius_km``, ``k`` and ``explain``
  are not rendered; only what the order asks of a driver is.

Orders and drivers are rendered with the same words (``electric``, ``refrigerated``,
``tail lift``, ``certifications: hazmat``, ``languages: en``, ``capacity 1200 kg``) so that
their embeddings land in a comparable space.

Numbers are rounded half-up (on the decimal value as written in JSON, so 0.9725 really is a
half) to this precision, and printed with a fixed number of decimals (never ``-0.0`` or
``1e-05``):

| field                          | precision             | rendered as                     |
|--------------------------------|-----------------------|---------------------------------|
| capacity_kg (cargo weight_kg)  | 10 kg                 | ``capacity 1200 kg``            |
| cargo_volume_m3 (volume_m3)    | 0.1 m3                | ``volume 8.5 m3``               |
| cargo_height_m (height_m)      | 0.05 m                | ``height 1.70 m``               |
| on_time_rate                   | 0.5 percentage points | ``on-time 97.5%``               |
| damage_rate                    | 0.1 percentage points | ``damage 0.2%``                 |
| service_score                  | 0.1                   | ``service 4.8 of 5``            |
| completed_orders               | bucket (below)        | ``1000-2499 completed orders``  |

completed_orders buckets: 0 (``new driver``), 1-9, 10-49, 50-99, 100-249, 250-499, 500-999,
1000-2499, 2500-4999, 5000-9999, 10000+ (``10000+ completed orders``).

``damage_rate`` gets a finer step than ``on_time_rate`` because real damage rates sit well
under 1%: at 0.5 points almost every driver would read 0.0%.

Other rules: lists (certifications, languages) are lower-cased, stripped, deduplicated and
sorted; underscores in certifications read as spaces (``food_safety`` -> ``food safety``);
free text (home zone, requirements) is lower-cased with whitespace collapsed. ``None``
values, empty lists, false flags and cargo dimensions that round to zero are omitted (never
rendered as "unknown"), always in the same way. Changing any rule here changes the text of
existing records: bump ``TEXT_SCHEMA_VERSION`` so old cached vectors are not reused.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Iterable
from decimal import ROUND_HALF_UP, Decimal
from functools import lru_cache

from features.models import Cargo, DriverRecord, Order, Profile, VehicleRecord

TEXT_SCHEMA_VERSION = "1"
"""Part of the engine fingerprint: vectors of texts rendered by other rules never mix."""

# Lower bounds of the completed_orders buckets and their labels, in ascending order.
_ORDER_BOUNDS: tuple[int, ...] = (0, 1, 10, 50, 100, 250, 500, 1000, 2500, 5000, 10000)
_ORDER_LABELS: tuple[str, ...] = (
    "new driver",
    *(f"{lo}-{hi - 1} completed orders" for lo, hi in itertools.pairwise(_ORDER_BOUNDS[1:])),
    f"{_ORDER_BOUNDS[-1]}+ completed orders",
)

# How an order's constraint reads; the words match what driver_text renders for the
# feature the constraint checks (features.constraints).
CONSTRAINT_PHRASES: dict[str, str] = {
    "electric_only": "electric vehicle",
    "refrigerated": "refrigerated",
    "tail_lift": "tail lift",
    "hazmat_certified": "certifications: hazmat",
    "english_speaking": "languages: en",
}


def _round(value: Decimal, step: str, decimals: int) -> str:
    unit = Decimal(step)
    rounded = (value / unit).to_integral_value(ROUND_HALF_UP) * unit
    if rounded.is_zero():
        rounded = Decimal(0)  # -0.0 would print as "-0.0"
    return f"{rounded:.{decimals}f}"


@lru_cache(maxsize=65536)
def format_rounded(value: float, step: str, decimals: int) -> str:
    """``value`` rounded half-up to a multiple of ``step``, printed with ``decimals`` places.

    Works on ``repr(value)`` as a Decimal, so the rounding follows the digits a person sees
    (binary floats would round 0.9725 down) and the output never uses an exponent. Cached:
    fleets repeat the same capacities and rates, and Decimal is the slow part of rendering.
    """
    return _round(Decimal(repr(float(value))), step, decimals)


def _weight(kg: float) -> str:
    return format_rounded(kg, "10", 0)


def _volume(m3: float) -> str:
    return format_rounded(m3, "0.1", 1)


def _height(m: float) -> str:
    return format_rounded(m, "0.05", 2)


@lru_cache(maxsize=65536)
def _percent(rate: float, step: str) -> str:
    return _round(Decimal(repr(float(rate))) * 100, step, 1)


def completed_orders_bucket(count: int) -> str:
    """The label of the bucket ``count`` falls in (see the module table)."""
    return _ORDER_LABELS[max(0, bisect.bisect_right(_ORDER_BOUNDS, count) - 1)]


def _clean(text: str) -> str:
    return " ".join(text.lower().split())


def _clean_list(items: Iterable[str], underscores_as_spaces: bool = False) -> list[str]:
    cleaned = (_clean(item.replace("_", " ") if underscores_as_spaces else item) for item in items)
    return sorted({item for item in cleaned if item})


def vehicle_text(v: VehicleRecord) -> str:
    """``electric van, refrigerated, tail lift; capacity 1200 kg, volume 8.5 m3, height
    1.70 m``; flags appear only when true, the vehicle id never."""
    kind = ", ".join(
        [f"{v.energy} {v.type}"]
        + (["refrigerated"] if v.refrigerated else [])
        + (["tail lift"] if v.tail_lift else [])
    )
    size = (
        f"capacity {_weight(v.capacity_kg)} kg, volume {_volume(v.cargo_volume_m3)} m3, "
        f"height {_height(v.cargo_height_m)} m"
    )
    return f"{kind}; {size}"


def _profile_text(p: Profile) -> str:
    parts: list[str] = []
    if certifications := _clean_list(p.certifications, underscores_as_spaces=True):
        parts.append("certifications: " + ", ".join(certifications))
    if languages := _clean_list(p.languages):
        parts.append("languages: " + ", ".join(languages))
    record: list[str] = []
    if p.on_time_rate is not None:
        record.append(f"on-time {_percent(p.on_time_rate, '0.5')}%")
    if p.damage_rate is not None:
        record.append(f"damage {_percent(p.damage_rate, '0.1')}%")
    if p.service_score is not None:
        record.append(f"service {format_rounded(p.service_score, '0.1', 1)} of 5")
    record.append(completed_orders_bucket(p.completed_orders))
    parts.append(", ".join(record))
    if p.home_zone is not None and (zone := _clean(p.home_zone)):
        parts.append(f"home zone {zone}")
    return "; ".join(parts)


def driver_text(d: DriverRecord) -> str:
    """Vehicle then profile, e.g. ``electric van, tail lift; capacity 1200 kg, volume 8.5 m3,
    height 1.70 m; certifications: hazmat; languages: en, zh; on-time 97.5%, damage 0.2%,
    service 4.8 of 5, 1000-2499 completed orders; home zone pudong``.

    Not rendered: ``driver_id`` (ids defeat cache sharing between identical profiles),
    ``status``, ``position`` and its timestamp (they change all the time; API.md).
    """
    return f"{vehicle_text(d.vehicle)}; {_profile_text(d.profile)}"


def _cargo_text(cargo: Cargo | None) -> str | None:
    if cargo is None:
        return None
    dims = [
        (_weight(cargo.weight_kg), "{} kg"),
        (_volume(cargo.volume_m3), "volume {} m3"),
        (_height(cargo.height_m), "height {} m"),
    ]
    shown = [template.format(value) for value, template in dims if not Decimal(value).is_zero()]
    return "cargo " + ", ".join(shown) if shown else None


def order_text(o: Order) -> str:
    """What the order asks of a driver, e.g. ``needs electric vehicle, refrigerated; cargo
    300 kg, volume 2.0 m3, height 1.20 m; requirements: fragile, fourth floor, no lift``.

    Constraints appear in vocabulary order whatever order the order lists them in; an
    unknown one (the proxy rejects those before embedding) follows, as its name with
    spaces. Not rendered: ``order_id``, the pickup point and time, ``radius_km``, ``k``,
    ``explain``.
    """
    asked = set(o.constraints)
    needs = [phrase for name, phrase in CONSTRAINT_PHRASES.items() if name in asked]
    unknown = {_clean(c.replace("_", " ")) for c in asked - CONSTRAINT_PHRASES.keys()}
    needs += sorted(unknown - {""})
    parts = ["needs " + (", ".join(needs) if needs else "any vehicle")]
    if (cargo := _cargo_text(o.cargo)) is not None:
        parts.append(cargo)
    if requirements := _clean(o.requirements):
        parts.append(f"requirements: {requirements}")
    return "; ".join(parts)


def record_text(record: DriverRecord | VehicleRecord | Order) -> str:
    """The canonical text of any record the service embeds."""
    if isinstance(record, DriverRecord):
        return driver_text(record)
    if isinstance(record, VehicleRecord):
        return vehicle_text(record)
    if isinstance(record, Order):
        return order_text(record)
    raise TypeError(f"no canonical text for {type(record).__name__}")


canonical_text = record_text
"""The name ARCHITECTURE.md uses for ``record_text``."""
