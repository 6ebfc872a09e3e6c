"""The constraint vocabulary of ``recommend`` and the cargo fit rule (API.md).

A constraint is a named predicate on a driver; an unknown name is an ``UnknownConstraintError``
that lists the known ones (the proxy answers 422 with it).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from features.models import Cargo, DriverRecord, VehicleRecord

Predicate = Callable[[DriverRecord], bool]

CONSTRAINTS: dict[str, Predicate] = {
    "electric_only": lambda d: d.vehicle.energy == "electric",
    "refrigerated": lambda d: d.vehicle.refrigerated,
    "tail_lift": lambda d: d.vehicle.tail_lift,
    "hazmat_certified": lambda d: "hazmat" in d.profile.certifications,
    "english_speaking": lambda d: "en" in d.profile.languages,
}


class UnknownConstraintError(ValueError):
    def __init__(self, unknown: list[str]) -> None:
        self.unknown = unknown
        self.known = sorted(CONSTRAINTS)
        super().__init__(
            f"unknown constraint(s) {', '.join(unknown)}; known: {', '.join(self.known)}"
        )


def check_constraints(names: Iterable[str]) -> list[str]:
    """Return the names, deduplicated in order; raise if any is unknown."""
    names = list(dict.fromkeys(names))
    unknown = [n for n in names if n not in CONSTRAINTS]
    if unknown:
        raise UnknownConstraintError(unknown)
    return names


def fits_cargo(vehicle: VehicleRecord, cargo: Cargo | None) -> bool:
    """Equal fits: capacity, volume and height each at least what the cargo needs."""
    if cargo is None:
        return True
    return (
        vehicle.capacity_kg >= cargo.weight_kg
        and vehicle.cargo_volume_m3 >= cargo.volume_m3
        and vehicle.cargo_height_m >= cargo.height_m
    )


def satisfies(driver: DriverRecord, constraints: Iterable[str], cargo: Cargo | None) -> bool:
    return fits_cargo(driver.vehicle, cargo) and all(CONSTRAINTS[c](driver) for c in constraints)
