"""compose.yaml and deploy/: what can be checked without Docker.

YAML structure and references (mounted files exist, services and dependencies agree,
healthchecks present, secrets where the settings look for them), ``promtool check config``,
``check rules`` and ``test rules`` (deploy/prometheus/alerts_test.yml) when promtool is
installed (Debian's ``prometheus`` package; ``make test`` installs it), and every metric the
Grafana dashboard or an alert rule queries is one the proxy really exports after a workload.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from engines.fake import FakeEngine
from proxy import stats
from proxy.app import create_app
from proxy.auth import add_key
from proxy.gpu_health import GpuMonitor
from tests.conftest import LiveServer, make_settings, open_client, wait_ready
from tests.test_metrics import fake_nvml, run_workload

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
PROMETHEUS_CONFIG = DEPLOY / "prometheus" / "prometheus.yml"
ALERTS = DEPLOY / "prometheus" / "alerts.yml"
ALERTS_TEST = DEPLOY / "prometheus" / "alerts_test.yml"
ALERTMANAGER_CONFIG = DEPLOY / "alertmanager" / "alertmanager.yml"
DASHBOARD = DEPLOY / "grafana" / "dashboards" / "fleetcache.json"
_METRIC = re.compile(r"\bfleetcache_[a-zA-Z0-9_]+")


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    data = yaml.safe_load((ROOT / "compose.yaml").read_text())
    assert isinstance(data, dict)
    return data


def test_compose_services_and_healthchecks(compose: dict[str, Any]) -> None:
    services = compose["services"]
    assert {"proxy", "redis", "redis-fleet", "prometheus", "alertmanager", "grafana"} <= set(
        services
    )
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


def promtool(*args: str) -> str:
    """``promtool ARGS``' output; the test fails when it does."""
    path = shutil.which("promtool")
    if path is None:
        pytest.skip("needs promtool (apt-get install prometheus)")
    result = subprocess.run([path, *args], capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def test_promtool_accepts_the_config(tmp_path: Path) -> None:
    """As compose lays it out: the config, the rules beside it and the key in secrets/."""
    shutil.copy(PROMETHEUS_CONFIG, tmp_path / "prometheus.yml")
    shutil.copy(ALERTS, tmp_path / "alerts.yml")
    (tmp_path / "secrets").mkdir()
    (tmp_path / "secrets" / "metrics.key").write_text("fc_example\n")
    out = promtool("check", "config", str(tmp_path / "prometheus.yml"))
    assert "SUCCESS: 12 rules found" in out


def test_alert_rules_pass_their_unit_tests() -> None:
    """deploy/prometheus/alerts_test.yml: each rule fires on the series that should trip it
    (p99 > 300 ms for 5 min, hit ratio halved against the last hour, 429s, engine tripped or
    degraded, drift, store degraded, GPU >= 83 C, memory bandwidth > 92%, uncorrected ECC)
    and not on normal ones."""
    assert "SUCCESS" in promtool("check", "rules", str(ALERTS))
    assert "SUCCESS" in promtool("test", "rules", str(ALERTS_TEST))
    rules = yaml.safe_load(ALERTS.read_text())
    names = {rule["alert"] for group in rules["groups"] for rule in group["rules"]}
    tested = yaml.safe_load(ALERTS_TEST.read_text())
    fired = {
        case["alertname"]
        for test in tested["tests"]
        for case in test["alert_rule_test"]
        if case["exp_alerts"]
    }
    assert fired == names, f"rules without a test that fires them: {sorted(names - fired)}"


def test_prometheus_loads_the_rules_and_sends_to_alertmanager(compose: dict[str, Any]) -> None:
    services = compose["services"]
    config = yaml.safe_load(PROMETHEUS_CONFIG.read_text())
    mounts = {v.split(":")[1]: v.split(":")[0] for v in services["prometheus"]["volumes"]}
    config_dir = Path(mounts["/etc/prometheus/prometheus.yml"]).parent
    assert config_dir == Path("./deploy/prometheus")
    for rule_file in config["rule_files"]:  # relative to the config, as Prometheus reads them
        assert mounts[f"/etc/prometheus/{rule_file}"] == f"./deploy/prometheus/{rule_file}"
    (manager,) = config["alerting"]["alertmanagers"]
    (target,) = manager["static_configs"][0]["targets"]
    host, port = target.split(":")
    alertmanager = services[host]
    assert any(p.endswith(f":{port}") for p in alertmanager["ports"])
    assert "/-/ready" in " ".join(alertmanager["healthcheck"]["test"])
    am_mounts = {v.split(":")[1]: v.split(":")[0] for v in alertmanager["volumes"]}
    assert (ROOT / am_mounts["/etc/alertmanager/alertmanager.yml"]) == ALERTMANAGER_CONFIG
    routes = yaml.safe_load(ALERTMANAGER_CONFIG.read_text())
    receivers = {r["name"] for r in routes["receivers"]}
    assert routes["route"]["receiver"] in receivers
    assert all(r["receiver"] in receivers for r in routes["route"]["routes"])
    assert services["prometheus"]["depends_on"]["alertmanager"]["condition"] == "service_healthy"


def test_prometheus_scrapes_with_a_key_when_metrics_are_not_public(
    compose: dict[str, Any],
) -> None:
    services, secrets = compose["services"], compose["secrets"]
    proxy = services["proxy"]["environment"]
    assert proxy["FLEETCACHE_METRICS_PUBLIC"] == "false"
    keys = proxy["FLEETCACHE_API_KEYS_FILE"]
    assert keys.startswith("/run/secrets/") and keys.split("/")[-1] in services["proxy"]["secrets"]
    (job,) = yaml.safe_load(PROMETHEUS_CONFIG.read_text())["scrape_configs"]
    auth = job["authorization"]
    assert auth["type"] == "Bearer"
    mounted = {s["target"]: s["source"] for s in services["prometheus"]["secrets"]}
    source = mounted[f"/etc/prometheus/{auth['credentials_file']}"]
    for name in (source, keys.split("/")[-1]):
        assert secrets[name]["file"].startswith("./deploy/secrets/")
    ignored = subprocess.run(
        ["git", "check-ignore", "-q", secrets[source]["file"]], cwd=ROOT, check=False
    )
    assert ignored.returncode == 0, "the keys must never be committed"


def test_a_key_from_a_credentials_file_opens_private_metrics(tmp_path: Path) -> None:
    """What Prometheus does under compose: Bearer <the file's content>, scope operator."""
    keys = tmp_path / "keys"
    (tmp_path / "metrics.key").write_text(add_key(keys, "prometheus", frozenset({"operator"})))
    dispatch = add_key(keys, "dispatcher", frozenset({"dispatch"}))
    settings = make_settings(tmp_path / "data", api_keys_file=keys, metrics_public=False)
    with open_client(settings) as client:
        wait_ready(client)
        token = (tmp_path / "metrics.key").read_text().strip()
        assert client.get("/metrics").status_code == 401
        denied = client.get("/metrics", headers={"Authorization": f"Bearer {dispatch}"})
        assert denied.status_code == 403
        scraped = client.get("/metrics", headers={"Authorization": f"Bearer {token}"})
        assert scraped.status_code == 200 and "fleetcache_ready 1.0" in scraped.text


def test_the_fleet_log_has_a_redis_of_its_own_that_keeps_its_data(
    compose: dict[str, Any],
) -> None:
    services = compose["services"]
    fleet = services["redis-fleet"]
    command = fleet["command"]

    def option(name: str) -> str:
        return str(command[command.index(f"--{name}") + 1])

    assert option("appendonly") == "yes"
    assert option("appendfsync") in ("always", "everysec")
    assert option("maxmemory-policy") == "noeviction"
    (volume,) = fleet["volumes"]
    assert volume.split(":")[1] == "/data" and volume.split(":")[0] in compose["volumes"]
    assert "ping" in fleet["healthcheck"]["test"]
    proxy = services["proxy"]
    assert proxy["environment"]["FLEETCACHE_FLEET_LOG_URL"] == "redis://redis-fleet:6379/0"
    assert proxy["depends_on"]["redis-fleet"]["condition"] == "service_healthy"
    cache = services["redis"]["command"]  # the cache may evict: never the fleet log's Redis
    assert cache[cache.index("--maxmemory-policy") + 1] == "allkeys-lru"


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


def alert_metric_names() -> set[str]:
    rules = yaml.safe_load(ALERTS.read_text())
    exprs = [rule["expr"] for group in rules["groups"] for rule in group["rules"]]
    return {name for expr in exprs for name in _METRIC.findall(expr)}


def exported(text: str) -> set[str]:
    return {
        sample.name
        for family in text_string_to_metric_families(text)
        for sample in family.samples  # names as scraped: _total, _bucket, _sum, _count
    }


def test_alert_rules_query_only_exported_metrics(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monitor = GpuMonitor(lambda: fake_nvml(), min_interval_s=0.0)
    monkeypatch.setattr(stats, "default_monitor", lambda: monitor)
    settings = make_settings(tmp_path, admin_token="deploy-admin", drift_interval_s=0)
    with open_client(settings) as client:
        wait_ready(client)
        run_workload(client)
        admin = {"Authorization": "Bearer deploy-admin"}
        assert client.post("/v1/cache/drift", headers=admin).json()["sampled"] > 0
        text = client.get("/metrics").text
    used = alert_metric_names()
    assert len(used) >= 10
    assert used <= exported(text), f"not exported: {sorted(used - exported(text))}"


def test_queue_rejections_are_counted_by_reason(tmp_path: Path) -> None:
    """A 429 for a full inference queue counts as queue_full (the alert on queue rejections)."""
    settings = make_settings(tmp_path, max_queue=4, max_texts_per_request=4, max_batch_size=1)
    with LiveServer(create_app(settings, engine=FakeEngine(delay_s=1.0))) as server:
        while httpx.get(f"{server.url}/readyz").status_code != 200:
            time.sleep(0.02)
        url = f"{server.url}/v1/embeddings"
        held = threading.Thread(
            target=httpx.post, args=(url,), kwargs={"json": {"input": list("abcd")}, "timeout": 30}
        )
        held.start()  # one text in the engine, two handed over ahead of it, one queued
        for _ in range(500):  # until the batcher holds them (not a guess at how long that takes)
            if httpx.get(f"{server.url}/v1/stats").json()["queue"]["depth"] >= 3:
                break
            time.sleep(0.01)
        refused = httpx.post(url, json={"input": ["e", "f", "g"]}, timeout=30)
        held.join()
        assert refused.status_code == 429 and "queue is full" in refused.text
        body = httpx.get(f"{server.url}/v1/stats").json()
        assert body["queue"]["rejected"] == {"worker_full": 0, "queue_full": 1}
        metrics = httpx.get(f"{server.url}/metrics").text
        assert 'fleetcache_requests_rejected_total{reason="queue_full"} 1.0' in metrics


def test_dashboard_queries_only_exported_metrics(
    client: TestClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a fake GPU, so that the GPU gauges are exported too (they are absent without one)
    monitor = GpuMonitor(lambda: fake_nvml(), min_interval_s=0.0)
    monkeypatch.setattr(stats, "default_monitor", lambda: monitor)
    run_workload(client)
    names = exported(client.get("/metrics").text)
    used = dashboard_metric_names()
    assert len(used) >= 10
    assert used <= names, f"not exported: {sorted(used - names)}"
