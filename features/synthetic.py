"""A synthetic fleet for demos, benchmarks and tests (``fleetcache gen-fleet``).

Drivers are scattered around real city centres (gaussian, sigma 7 km per axis: about 90%
within 15 km), drive vehicles from a small per-type catalogue (fleets buy the same models, so
many drivers share a vehicle text), and carry profiles whose statistics look like a real
fleet's. The numbers are plausible, not measured; what matters is that they exercise the
cache, the index and the constraint filters the way production data would.

Deterministic: the same ``(n, seed, cities)`` gives identical records, and a smaller fleet is
a prefix of a larger one with the same seed (records are drawn in fixed-size blocks, each
from its own generator seeded with ``(seed, block)``).
"""

from __future__ import annotations

import gc
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import numpy as np
import numpy.typing as npt

from features.models import DriverRecord, Order
from features.text import driver_text, order_text, vehicle_text

_BLOCK = 4096
_SIGMA_KM = 7.0
_KM_PER_DEG_LAT = 111.32
_BASE_TS = datetime(2026, 11, 30, 10, 0, tzinfo=UTC)


@dataclass(frozen=True)
class City:
    lat: float
    lng: float
    zones: tuple[str, ...]
    # (language, probability a driver speaks it); the first is the local language.
    languages: tuple[tuple[str, float], ...]


CITIES: dict[str, City] = {
    "shanghai": City(
        31.2304,
        121.4737,
        ("pudong", "huangpu", "jingan", "xuhui", "changning", "minhang"),
        (("zh", 1.0), ("en", 0.3)),
    ),
    "shenzhen": City(
        22.5431,
        114.0579,
        ("futian", "nanshan", "luohu", "bao'an", "longgang"),
        (("zh", 1.0), ("yue", 0.3), ("en", 0.25)),
    ),
    "london": City(
        51.5072,
        -0.1276,
        ("westminster", "camden", "hackney", "southwark", "islington", "croydon"),
        (("en", 1.0), ("pl", 0.08), ("hi", 0.06), ("ro", 0.05)),
    ),
    "berlin": City(
        52.5200,
        13.4050,
        ("mitte", "kreuzberg", "neukölln", "charlottenburg", "pankow"),
        (("de", 1.0), ("en", 0.5), ("tr", 0.15)),
    ),
    "new york": City(
        40.7128,
        -74.0060,
        ("manhattan", "brooklyn", "queens", "bronx", "staten island"),
        (("en", 1.0), ("es", 0.35), ("zh", 0.05)),
    ),
    "são paulo": City(
        -23.5505,
        -46.6333,
        ("pinheiros", "moema", "sé", "tatuapé", "santana"),
        (("pt", 1.0), ("es", 0.15), ("en", 0.15)),
    ),
}


@dataclass(frozen=True)
class VehicleSpec:
    share: float
    # (capacity_kg, cargo_volume_m3, cargo_height_m): the catalogue of models of this type.
    models: tuple[tuple[float, float, float], ...]
    energies: tuple[tuple[str, float], ...]
    refrigerated: float
    tail_lift: float
    # (certification, probability) for drivers of this type, at most four (the fifth
    # uniform drawn per driver decides food_safety).
    certifications: tuple[tuple[str, float], ...]


VEHICLE_TYPES: dict[str, VehicleSpec] = {
    "e-bike": VehicleSpec(
        0.15,
        ((20.0, 0.06, 0.35), (30.0, 0.1, 0.4), (40.0, 0.14, 0.45)),
        (("electric", 1.0),),
        0.05,
        0.0,
        (("first_aid", 0.05),),
    ),
    "motorbike": VehicleSpec(
        0.15,
        ((40.0, 0.12, 0.4), (60.0, 0.18, 0.45), (80.0, 0.25, 0.5)),
        (("gasoline", 0.7), ("electric", 0.3)),
        0.05,
        0.0,
        (("first_aid", 0.05),),
    ),
    "car": VehicleSpec(
        0.2,
        ((300.0, 0.9, 0.85), (400.0, 1.4, 0.95), (500.0, 2.0, 1.05)),
        (("gasoline", 0.45), ("hybrid", 0.3), ("electric", 0.2), ("diesel", 0.05)),
        0.03,
        0.0,
        (("first_aid", 0.08),),
    ),
    "van": VehicleSpec(
        0.35,
        ((600.0, 4.3, 1.35), (900.0, 6.7, 1.5), (1200.0, 8.5, 1.7), (1500.0, 13.5, 1.9)),
        (("diesel", 0.5), ("electric", 0.3), ("gasoline", 0.1), ("hybrid", 0.1)),
        0.15,
        0.3,
        (("hazmat", 0.08), ("adr", 0.05), ("forklift", 0.1), ("first_aid", 0.1)),
    ),
    "truck": VehicleSpec(
        0.15,
        ((2000.0, 16.0, 2.0), (3500.0, 22.0, 2.2), (7500.0, 38.0, 2.45), (12000.0, 55.0, 2.65)),
        (("diesel", 0.85), ("electric", 0.1), ("hybrid", 0.05)),
        0.2,
        0.6,
        (("hazmat", 0.25), ("adr", 0.2), ("forklift", 0.3), ("first_aid", 0.15)),
    ),
}

STATUSES: tuple[tuple[str, float], ...] = (("available", 0.6), ("busy", 0.3), ("offline", 0.1))
_FOOD_SAFETY = (0.7, 0.05)  # probability if refrigerated, if not


def _weights(weighted: Sequence[tuple[str, float]]) -> npt.NDArray[np.float64]:
    w = np.array([p for _, p in weighted], dtype=np.float64)
    return w / w.sum()


def _choose(
    rng: np.random.Generator, weighted: Sequence[tuple[str, float]], size: int
) -> npt.NDArray[np.intp]:
    return rng.choice(len(weighted), size=size, p=_weights(weighted))


def _resolve_cities(cities: Sequence[str] | None) -> list[str]:
    if cities is None:
        return list(CITIES)
    if isinstance(cities, str):
        cities = [cities]
    names = list(dict.fromkeys(c.strip().lower() for c in cities))
    unknown = [c for c in names if c not in CITIES]
    if unknown or not names:
        raise ValueError(f"unknown cities {unknown or '(none given)'}; known: {', '.join(CITIES)}")
    return names


def _per_type(
    type_idx: npt.NDArray[np.intp],
    u: npt.NDArray[np.float64],
    pick: Callable[[VehicleSpec, npt.NDArray[np.float64]], npt.NDArray[Any]],
) -> npt.NDArray[Any]:
    """Apply each type's own rule to the uniforms of the drivers of that type."""
    out = np.zeros(len(u), dtype=np.int64)
    for t, vtype in enumerate(VEHICLE_TYPES.values()):
        mask = type_idx == t
        out[mask] = pick(vtype, u[mask])
    return out


def _block(seed: int, block: int, cities: list[str]) -> Iterator[dict[str, Any]]:
    """One block of ``_BLOCK`` drivers as plain dicts (ids still missing), drawn vectorised."""
    rng = np.random.default_rng([seed, block])
    n = _BLOCK
    centres = [CITIES[c] for c in cities]
    city_idx = rng.integers(len(centres), size=n)
    c_lat = np.array([c.lat for c in centres])[city_idx]
    c_lng = np.array([c.lng for c in centres])[city_idx]
    north, east = rng.normal(0.0, _SIGMA_KM, size=(2, n))
    lat = np.clip(c_lat + north / _KM_PER_DEG_LAT, -90.0, 90.0)
    lng = c_lng + east / (_KM_PER_DEG_LAT * np.cos(np.radians(c_lat)))
    lng = (lng + 180.0) % 360.0 - 180.0
    age_s = rng.integers(0, 600, size=n)
    status = _choose(rng, STATUSES, n)

    type_names = list(VEHICLE_TYPES)
    type_idx = _choose(rng, [(t, v.share) for t, v in VEHICLE_TYPES.items()], n)
    u_model, u_energy, u_fridge, u_lift, u_zone = rng.random(size=(5, n))
    model = _per_type(type_idx, u_model, lambda v, u: (u * len(v.models)).astype(np.int64))
    energy = _per_type(
        type_idx, u_energy, lambda v, u: np.searchsorted(np.cumsum(_weights(v.energies)), u)
    )
    fridge = _per_type(type_idx, u_fridge, lambda v, u: u < v.refrigerated).astype(bool)
    lift = _per_type(type_idx, u_lift, lambda v, u: u < v.tail_lift).astype(bool)
    u_certs = rng.random(size=(n, 5))
    u_langs = rng.random(size=(n, 4))

    completed = np.floor(rng.lognormal(math.log(600.0), 1.3, size=n)).astype(np.int64)
    completed[rng.random(size=n) < 0.05] = 0  # new drivers
    on_time = np.round(1.0 - rng.beta(2.0, 40.0, size=n), 3)
    damage = np.round(rng.beta(1.0, 400.0, size=n), 4)
    service = np.round(np.clip(rng.normal(4.6, 0.25, size=n), 1.0, 5.0), 2)

    rows = zip(
        lat.tolist(),
        lng.tolist(),
        age_s.tolist(),
        status.tolist(),
        city_idx.tolist(),
        type_idx.tolist(),
        model.tolist(),
        energy.tolist(),
        fridge.tolist(),
        lift.tolist(),
        u_certs.tolist(),
        u_langs.tolist(),
        u_zone.tolist(),
        completed.tolist(),
        on_time.tolist(),
        damage.tolist(),
        service.tolist(),
        strict=True,
    )
    for la, ln, age, st, ci, ti, mi, ei, rf, tl, uc, ul, uz, done, ot, dm, sv in rows:
        vtype = VEHICLE_TYPES[type_names[ti]]
        capacity, volume, height = vtype.models[mi]
        certs = [name for (name, p), u in zip(vtype.certifications, uc, strict=False) if u < p]
        if uc[4] < _FOOD_SAFETY[0 if rf else 1]:
            certs.append("food_safety")
        city = centres[ci]
        has_stats = done >= 10  # a fleet system has no meaningful rates for a new driver
        yield {
            "status": STATUSES[st][0],
            "position": {"lat": la, "lng": ln, "ts": _BASE_TS - timedelta(seconds=age)},
            "vehicle": {
                "type": type_names[ti],
                "energy": vtype.energies[ei][0],
                "capacity_kg": capacity,
                "cargo_volume_m3": volume,
                "cargo_height_m": height,
                "refrigerated": rf,
                "tail_lift": tl,
            },
            "profile": {
                "on_time_rate": ot if has_stats else None,
                "damage_rate": dm if has_stats else None,
                "service_score": sv if has_stats else None,
                "completed_orders": done,
                "certifications": certs,
                "languages": [
                    lang for (lang, p), u in zip(city.languages, ul, strict=False) if u < p
                ],
                "home_zone": city.zones[int(uz * len(city.zones))],
            },
        }


def iter_fleet(
    n: int, seed: int = 0, cities: Sequence[str] | None = None
) -> Iterator[DriverRecord]:
    """Yield ``n`` validated drivers ``D000000``.. with vehicles ``V000000``.. (constant memory).

    ``cities`` restricts the fleet to some of ``CITIES`` (names as keys there, any case).
    """
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    names = _resolve_cities(cities)
    index = 0
    for block in range(math.ceil(n / _BLOCK)):
        for fields in _block(seed, block, names):
            if index >= n:
                return
            fields["driver_id"] = f"D{index:06d}"
            fields["vehicle"]["vehicle_id"] = f"V{index:06d}"
            yield DriverRecord.model_validate(fields)
            index += 1


def generate_fleet(
    n: int, seed: int = 0, cities: Sequence[str] | None = None
) -> list[DriverRecord]:
    """``iter_fleet`` as a list.

    The cyclic garbage collector is paused while the list grows (and restored after, also on
    error): each of its full passes walks every record built so far, which measured 8.7 s
    instead of 3 s for 100,000 drivers. Reference counting still frees everything; records
    hold no cycles.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        return list(iter_fleet(n, seed, cities))
    finally:
        if was_enabled:
            gc.enable()


def fleet_texts(n: int, seed: int = 0) -> list[str]:
    """The texts the cache embeds for a fleet of ``n`` drivers in every city (accented and CJK
    place names included): each driver's and each vehicle's, and an order at each of the first
    ``n // 10`` drivers' positions (cargo, the driver's certifications as constraints, free
    text naming the driver)."""
    drivers = generate_fleet(n, seed, list(CITIES))
    orders = [
        Order.model_validate(
            {
                "order_id": f"o{i}",
                "pickup": {"lat": d.position.lat, "lng": d.position.lng},
                "pickup_time": datetime(2026, 12, 1, 8, tzinfo=UTC),
                "cargo": {"weight_kg": 10.0 * (i % 300), "volume_m3": 0.1 * (i % 300)},
                "constraints": d.profile.certifications,
                "requirements": f"fragile load for {d.driver_id}, ring at gate {i % 7}",
            }
        )
        for i, d in enumerate(drivers[: n // 10])
    ]
    vehicles = [vehicle_text(d.vehicle) for d in drivers]
    return [driver_text(d) for d in drivers] + vehicles + [order_text(o) for o in orders]
