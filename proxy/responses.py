"""JSON responses through orjson: numpy rows serialise natively, ~10x faster than json."""

from __future__ import annotations

from typing import Any

import orjson
from fastapi.responses import JSONResponse


class FastJSONResponse(JSONResponse):
    def render(self, content: Any) -> bytes:
        return orjson.dumps(content, option=orjson.OPT_SERIALIZE_NUMPY)
