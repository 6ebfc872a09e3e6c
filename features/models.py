"""The records the fleet system sends and the orders dispatch asks about (API.md, "Records").

Unknown extra fields are ignored; a missing or out-of-range required field is a pydantic
``ValidationError`` that names it (the proxy turns it into a 422).

Bounds are generous for any real vehicle but keep the embedded text sane: without them a
``capacity_kg`` of 1e308 rendered a 308-digit number into the text and ``completed_orders``
of 10**400 was accepted (issue 12). Identifiers carry no control characters (a NUL in an id
ended up in store keys and logs; C1 ones such as U+009B, a terminal's CSI, are refused too).
A time is one whose instant in UTC lies in the years 1 to 9999: with an offset,
``9999-12-31T23:59:59-01:00`` is in year 10000, which the fleet index could neither store nor
load again (a snapshot holding one stopped the index from starting).
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StrictBool, StringConstraints

Status = Literal["available", "busy", "offline"]
VehicleType = Literal["car", "van", "truck", "e-bike", "motorbike"]
Energy = Literal["electric", "diesel", "gasoline", "hybrid"]
NO_CONTROL = r"^[^\x00-\x1f\x7f-\x9f]*$"  # C0, DEL and C1
Identifier = Annotated[
    str,
    StringConstraints(strip_whitespace=True, min_length=1, max_length=128, pattern=NO_CONTROL),
]
Latitude = Annotated[float, Field(ge=-90.0, le=90.0, allow_inf_nan=False)]
Longitude = Annotated[float, Field(ge=-180.0, le=180.0, allow_inf_nan=False)]
Rate = Annotated[float, Field(ge=0.0, le=1.0, allow_inf_nan=False)]
# kg, m3, m: above the largest road vehicles (a 60 t road train, ~150 m3, 5 m high)
Kilograms = Annotated[float, Field(ge=0.0, le=100_000.0, allow_inf_nan=False)]
CubicMetres = Annotated[float, Field(ge=0.0, le=1_000.0, allow_inf_nan=False)]
Metres = Annotated[float, Field(ge=0.0, le=20.0, allow_inf_nan=False)]
Label = Annotated[str, StringConstraints(max_length=64)]


def _in_utc_years(ts: datetime) -> datetime:
    """``ts`` if its instant in UTC is one a datetime holds (a naive time is taken as UTC)."""
    if ts.tzinfo is not None:
        try:
            ts.astimezone(UTC)
        except OverflowError:
            raise ValueError("its time in UTC is outside the years 1 to 9999") from None
    return ts


Timestamp = Annotated[datetime, AfterValidator(_in_utc_years)]


class _Record(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)


class LatLng(_Record):
    lat: Latitude
    lng: Longitude


class Position(LatLng):
    ts: Timestamp | None = None


class VehicleRecord(_Record):
    vehicle_id: Identifier
    type: VehicleType
    energy: Energy
    capacity_kg: Kilograms
    cargo_volume_m3: CubicMetres
    cargo_height_m: Metres
    refrigerated: bool = False
    tail_lift: bool = False


class Profile(_Record):
    on_time_rate: Rate | None = None
    damage_rate: Rate | None = None
    service_score: Annotated[float, Field(ge=0.0, le=5.0, allow_inf_nan=False)] | None = None
    completed_orders: Annotated[int, Field(ge=0, le=10**9)] = 0
    certifications: list[Label] = Field(default=[], max_length=64)
    languages: list[Annotated[str, StringConstraints(max_length=16)]] = Field(
        default=[], max_length=64
    )
    home_zone: Label | None = None


class DriverRecord(_Record):
    driver_id: Identifier
    status: Status
    position: Position
    vehicle: VehicleRecord
    profile: Profile = Profile()


class Cargo(_Record):
    """What an order carries; a field left out asks nothing of the vehicle."""

    weight_kg: Kilograms = 0.0
    volume_m3: CubicMetres = 0.0
    height_m: Metres = 0.0


def _now() -> datetime:
    return datetime.now(UTC)


class Order(_Record):
    """A dispatch question (``POST /v1/dispatch/recommend``); defaults as API.md."""

    order_id: Identifier
    pickup: LatLng
    pickup_time: Timestamp = Field(default_factory=_now)
    cargo: Cargo | None = None
    constraints: list[Annotated[str, StringConstraints(max_length=64)]] = Field(
        default=[], max_length=32
    )
    requirements: Annotated[str, StringConstraints(max_length=2000)] = ""
    radius_km: Annotated[float, Field(gt=0.0, le=100.0, allow_inf_nan=False)] = 5.0
    k: Annotated[int, Field(ge=1, le=200, strict=True)] = 10
    explain: StrictBool = False
