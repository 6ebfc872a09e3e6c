"""Great-circle distance on the sphere API.md names (radius 6371.0088 km, the IUGG mean)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

EARTH_RADIUS_KM = 6371.0088


def haversine_km(lat1: float, lng1: float, lat2: float, lng2: float) -> float:
    p1, p2 = math.radians(lat1), math.radians(lat2)
    dp, dl = p2 - p1, math.radians(lng2 - lng1)
    h = math.sin(dp / 2) ** 2 + math.cos(p1) * math.cos(p2) * math.sin(dl / 2) ** 2
    return 2 * EARTH_RADIUS_KM * math.asin(min(1.0, math.sqrt(h)))


def haversine_km_many(
    lat: float, lng: float, lats: npt.NDArray[np.float64], lngs: npt.NDArray[np.float64]
) -> npt.NDArray[np.float64]:
    """Distances from one point to many, vectorised; same formula as ``haversine_km``."""
    return haversine_km_each([(lat, lng)], [len(lats)], lats, lngs)


def haversine_km_each(
    origins: Sequence[tuple[float, float]],
    counts: Sequence[int],
    lats: npt.NDArray[np.float64],
    lngs: npt.NDArray[np.float64],
) -> npt.NDArray[np.float64]:
    """``haversine_km_many(*origins[j], ...)`` for each j over its ``counts[j]`` points (all
    of them one after another in ``lats``, ``lngs``), in one vectorised pass: each origin's
    radians and cosine come from ``math``, and every array operation acts element by element,
    so each distance has the same bits whichever origins share the call."""
    p1 = np.repeat([math.radians(lat) for lat, _ in origins], counts)
    cos_p1 = np.repeat([math.cos(math.radians(lat)) for lat, _ in origins], counts)
    lng1 = np.repeat([lng for _, lng in origins], counts)
    p2 = np.radians(lats)
    dp, dl = p2 - p1, np.radians(lngs - lng1)
    h = np.sin(dp / 2) ** 2 + cos_p1 * np.cos(p2) * np.sin(dl / 2) ** 2
    return 2 * EARTH_RADIUS_KM * np.arcsin(np.minimum(1.0, np.sqrt(h)))
