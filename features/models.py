"""The records the fleet system sends and the orders dispatch asks about (API.md, "Records").

Unknown extra fields are ignored; a missing or out-of-range required field is a pydantic
``ValidationError`` that names it (the proxy turns it into a 422).
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints

Status = Literal["available", "busy", "offline"]
VehicleType = Literal["car", "van", "truck", "e-bike", "motorbike"]
Energy = Literal["electric", "diesel", "gasoline", "hybrid"]
Identifier = Annotated[str, StringConstraints(strip_whitespace=True, min_length=1, max_length=128)]
Latitude = Annotated[float, Field(ge=-90.0, le=90.0, allow_inf_nan=False)]
Longitude = Annotated[float, Field(ge=-180.0, le=180.0, allow_inf_nan=False)]
NonNegative = Annotated[float, Field(ge=0.0, allow_inf_nan=False)]
Rate = Annotated[float, Field(ge=0.0, le=1.0, allow_inf_nan=False)]


class _Record(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)


class LatLng(_Record):
    lat: Latitude
    lng: Longitude


class Position(LatLng):
    ts: datetime | None = None


class VehicleRecord(_Record):
    vehicle_id: Identifier
    type: VehicleType
    energy: Energy
    capacity_kg: NonNegative
    cargo_volume_m3: NonNegative
    cargo_height_m: NonNegative
    refrigerated: bool = False
    tail_lift: bool = False


class Profile(_Record):
    on_time_rate: Rate | None = None
    damage_rate: Rate | None = None
    service_score: Annotated[float, Field(ge=0.0, le=5.0, allow_inf_nan=False)] | None = None
    completed_orders: Annotated[int, Field(ge=0)] = 0
    certifications: list[Annotated[str, StringConstraints(max_length=64)]] = []
    languages: list[Annotated[str, StringConstraints(max_length=16)]] = []
    home_zone: Annotated[str, StringConstraints(max_length=64)] | None = None


class DriverRecord(_Record):
    driver_id: Identifier
    status: Status
    position: Position
    vehicle: VehicleRecord
    profile: Profile = Profile()


class Cargo(_Record):
    """What an order carries; a field left out asks nothing of the vehicle."""

    weight_kg: NonNegative = 0.0
    volume_m3: NonNegative = 0.0
    height_m: NonNegative = 0.0


def _now() -> datetime:
    return datetime.now(UTC)


class Order(_Record):
    """A dispatch question (``POST /v1/dispatch/recommend``); defaults as API.md."""

    order_id: Identifier
    pickup: LatLng
    pickup_time: datetime = Field(default_factory=_now)
    cargo: Cargo | None = None
    constraints: list[str] = []
    requirements: Annotated[str, StringConstraints(max_length=2000)] = ""
    radius_km: Annotated[float, Field(gt=0.0, le=100.0, allow_inf_nan=False)] = 5.0
    k: Annotated[int, Field(ge=1, le=200)] = 10
    explain: bool = False
