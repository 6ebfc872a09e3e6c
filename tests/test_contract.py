"""The service against its own OpenAPI schema (schemathesis), as client generators and contract
fuzzers read it (issue 12, defect 10): no 5xx, every status code documented, every answer's
body (errors included: our ``{"error": ...}`` shape) and content type as the schema says.

Bounded: a few dozen generated requests per operation, about a minute in all. Run it longer by
hand with ``CONTRACT_EXAMPLES=500 .venv/bin/pytest tests/test_contract.py``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from engines.fake import FakeEngine
from proxy.app import create_app
from tests.conftest import LiveServer, make_settings

ADMIN = "contract-admin-token"
EXAMPLES = os.environ.get("CONTRACT_EXAMPLES", "40")
SEED = os.environ.get("CONTRACT_SEED", "1")  # the same run in CI; vary it by hand
CHECKS = ",".join(
    (
        "not_a_server_error",
        "status_code_conformance",
        "content_type_conformance",
        "response_schema_conformance",
        "response_headers_conformance",
    )
)
CLI = Path(sys.executable).parent / "schemathesis"


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    data = tmp_path_factory.mktemp("contract") / "data"
    app = create_app(make_settings(data, demo_drivers=50, admin_token=ADMIN), engine=FakeEngine())
    with LiveServer(app) as server:
        deadline = time.monotonic() + 60
        while httpx.get(f"{server.url}/readyz").status_code != 200:
            assert time.monotonic() < deadline, "not ready"
            time.sleep(0.05)
        yield server


def test_every_answer_keeps_the_contract(live: LiveServer, tmp_path: Path) -> None:
    """schemathesis' CLI (its pytest plugin does not load under this pytest), every phase:
    examples, coverage, fuzzing, stateful sequences."""
    command = [str(CLI), "run", f"{live.url}/openapi.json", "--checks", CHECKS]
    command += ["--max-examples", EXAMPLES, "--seed", SEED, "--no-color"]
    command += ["-H", f"Authorization: Bearer {ADMIN}", "--report-dir", str(tmp_path)]
    run = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert run.returncode == 0, run.stdout[-20000:] + run.stderr[-5000:]
    assert "0 unique failures" in run.stdout or "passed" in run.stdout
