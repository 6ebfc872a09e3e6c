"""compose.yaml and deploy/: what can be checked without Docker.

YAML structure and references (mounted files exist, services and dependencies agree,
healthchecks present), ``promtool check config`` when promtool is installed (Debian's
``prometheus`` package), and every metric the Grafana dashboard queries is one the proxy
really exports after a workload.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from proxy import stats
from proxy.gpu_health import GpuMonitor
from tests.test_metrics import fake_nvml, run_workload

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
PROMETHEUS_CONFIG = DEPLOY / "prometheus" / "prometheus.yml"
DASHBOARD = DEPLOY / "grafana" / "dashboards" / "fleetcache.json"
_METRIC = re.compile(r"\bfleetcache_[a-zA-Z0-9_]+")


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    data = yaml.safe_load((ROOT / "compose.yaml").read_text())
    assert isinstance(data, dict)
    return data


def test_compose_services_and_healthchecks(compose: dict[str, Any]) -> None:
    services = compose["services"]
    assert {"proxy", "redis", "prometheus", "grafana"} <= set(services)
    for name, service in services.items():
        check = service.get("healthcheck")
        assert check and check["test"], f"{name} has no healthcheck"
        for dependency, condition in service.get("depends_on", {}).items():
            assert dependency in services, f"{name} depends on unknown {dependency}"
            if condition.get("condition") == "service_healthy":
                assert "healthcheck" in services[dependency]
    assert "/readyz" in " ".join(services["proxy"]["healthcheck"]["test"])
    devices = services["proxy"]["deploy"]["resources"]["reservations"]["devices"]
    assert any("gpu" in device["capabilities"] for device in devices)
    assert services["proxy"]["environment"]["FLEETCACHE_REDIS_URL"].startswith("redis://redis:")


def test_compose_mounts_and_volumes_exist(compose: dict[str, Any]) -> None:
    named = set(compose.get("volumes") or {})
    for name, service in compose["services"].items():
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("."):
                assert (ROOT / source).exists(), f"{name} mounts missing {source}"
            else:
                assert source in named, f"{name} uses undeclared volume {source}"
    if "build" in compose["services"]["proxy"]:
        assert (ROOT / "Dockerfile").exists()


def test_prometheus_scrapes_the_proxy(compose: dict[str, Any]) -> None:
    config = yaml.safe_load(PROMETHEUS_CONFIG.read_text())
    targets = [
        target
        for job in config["scrape_configs"]
        for static in job["static_configs"]
        for target in static["targets"]
    ]
    assert targets
    container_ports = {p.split(":")[-1] for p in compose["services"]["proxy"]["ports"]}
    for target in targets:
        host, port = target.split(":")
        assert host in compose["services"], f"scrape target {target} is not a compose service"
        assert host != "proxy" or port in container_ports
    assert all(
        job.get("metrics_path", "/metrics") == "/metrics" for job in config["scrape_configs"]
    )


def test_promtool_accepts_the_config() -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("needs promtool (apt-get install prometheus)")
    result = subprocess.run(
        [promtool, "check", "config", str(PROMETHEUS_CONFIG)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_grafana_provisioning_is_consistent(compose: dict[str, Any]) -> None:
    grafana = compose["services"]["grafana"]
    mounts = {v.split(":")[0]: v.split(":")[1] for v in grafana["volumes"]}
    provisioning = DEPLOY / "grafana" / "provisioning"
    datasources = yaml.safe_load((provisioning / "datasources" / "prometheus.yml").read_text())
    (source,) = datasources["datasources"]
    assert source["type"] == "prometheus"
    assert source["url"].split("//")[1].split(":")[0] in compose["services"]
    providers = yaml.safe_load((provisioning / "dashboards" / "fleetcache.yml").read_text())
    path = providers["providers"][0]["options"]["path"]
    assert mounts["./deploy/grafana/dashboards"] == path
    assert mounts["./deploy/grafana/provisioning"] == "/etc/grafana/provisioning"

    dashboard = json.loads(DASHBOARD.read_text())
    titles = " ".join(panel["title"].lower() for panel in dashboard["panels"])
    for needed in ("p99", "hit ratio", "calls avoided", "saved"):
        assert needed in titles
    for panel in dashboard["panels"]:
        assert panel["datasource"]["uid"] == source["uid"]
        assert panel["targets"] and all(t["expr"] for t in panel["targets"])


def dashboard_metric_names() -> set[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    return {name for expr in exprs for name in _METRIC.findall(expr)}


def test_dashboard_queries_only_exported_metrics(
    client: TestClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a fake GPU, so that the GPU gauges are exported too (they are absent without one)
    monitor = GpuMonitor(lambda: fake_nvml(), min_interval_s=0.0)
    monkeypatch.setattr(stats, "default_monitor", lambda: monitor)
    run_workload(client)
    text = client.get("/metrics").text
    exported = {
        sample.name
        for family in text_string_to_metric_families(text)
        for sample in family.samples  # names as scraped: _total, _bucket, _sum, _count
    }
    used = dashboard_metric_names()
    assert len(used) >= 10
    assert used <= exported, f"not exported: {sorted(used - exported)}"
