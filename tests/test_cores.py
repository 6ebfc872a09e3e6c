"""The cores a server may use, and the ``auto`` counts sized by them (proxy.cores).

A container limited to 4 CPUs on a 64-core host must start processes for 4 cores, not 64:
the cgroup files are laid out here as Linux shows them, under a temporary root."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from proxy import cores, engine_host, jobs, supervisor
from proxy.cores import cgroup_cpus, usable_cores
from proxy.processes import ChildSpec
from proxy.settings import Settings

V2_MOUNT = "30 23 0:26 / /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw,nsdelegate"


def machine(root: Path, cgroup: str, mounts: list[str], files: dict[str, str]) -> Path:
    """``/proc/self/cgroup``, ``/proc/self/mountinfo`` and cgroup files under ``root``."""
    (root / "proc/self").mkdir(parents=True)
    (root / "proc/self/cgroup").write_text(cgroup)
    (root / "proc/self/mountinfo").write_text("\n".join(mounts) + "\n")
    for path, text in files.items():
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_text(text)
    return root


def test_a_container_with_a_cgroup_v2_quota_has_that_many_cpus(tmp_path: Path) -> None:
    """``docker run --cpus 4`` with a cgroup namespace: its cgroup is the mount's root."""
    root = machine(tmp_path, "0::/\n", [V2_MOUNT], {"sys/fs/cgroup/cpu.max": "400000 100000\n"})
    assert cgroup_cpus(root) == 4.0


def test_a_quota_above_the_process_cgroup_counts(tmp_path: Path) -> None:
    """A Kubernetes pod's limit sits on the pod's cgroup, not the container's: the smallest
    quota on the way up is the one that holds."""
    pod = "sys/fs/cgroup/kubepods/pod1"
    root = machine(
        tmp_path,
        "0::/kubepods/pod1/ctr\n",
        [V2_MOUNT],
        {
            "sys/fs/cgroup/kubepods/cpu.max": "max 100000\n",
            f"{pod}/cpu.max": "250000 100000\n",
            f"{pod}/ctr/cpu.max": "max 100000\n",
        },
    )
    assert cgroup_cpus(root) == 2.5


def test_a_cgroup_v1_quota_is_read_where_its_hierarchy_is_mounted(tmp_path: Path) -> None:
    """Docker on cgroup v1: the container's own cgroup (/docker/abc) mounted as the root of
    the cpu,cpuacct hierarchy."""
    mount = "40 31 0:30 /docker/abc /sys/fs/cgroup/cpu,cpuacct rw - cgroup cgroup rw,cpu,cpuacct"
    root = machine(
        tmp_path,
        "5:memory:/docker/abc\n4:cpu,cpuacct:/docker/abc\n0::/\n",
        [mount],
        {
            "sys/fs/cgroup/cpu,cpuacct/cpu.cfs_quota_us": "150000\n",
            "sys/fs/cgroup/cpu,cpuacct/cpu.cfs_period_us": "100000\n",
        },
    )
    assert cgroup_cpus(root) == 1.5


def test_no_quota_anywhere_is_none(tmp_path: Path) -> None:
    """A hybrid host (v1 cpu unlimited, v2 mounted without the cpu controller), and a
    machine whose /proc says nothing."""
    v1 = "32 31 0:29 / /sys/fs/cgroup/cpu rw - cgroup cgroup rw,cpu"
    unified = "41 31 0:38 / /sys/fs/cgroup/unified rw - cgroup2 cgroup2 rw"
    root = machine(
        tmp_path / "hybrid",
        "1:cpu:/\n0::/\n",
        [v1, unified],
        {
            "sys/fs/cgroup/cpu/cpu.cfs_quota_us": "-1\n",
            "sys/fs/cgroup/cpu/cpu.cfs_period_us": "100000\n",
            "sys/fs/cgroup/unified/cgroup.procs": "1\n",
        },
    )
    assert cgroup_cpus(root) is None
    assert cgroup_cpus(tmp_path / "empty") is None


def test_usable_cores_is_the_affinity_mask_capped_by_the_quota_rounded_up(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    limited = machine(
        tmp_path / "limited", "0::/\n", [V2_MOUNT], {"sys/fs/cgroup/cpu.max": "250000 100000"}
    )
    unlimited = machine(
        tmp_path / "unlimited", "0::/\n", [V2_MOUNT], {"sys/fs/cgroup/cpu.max": "max 100000"}
    )
    monkeypatch.setattr(cores.os, "sched_getaffinity", lambda pid: set(range(64)), raising=False)
    assert usable_cores(limited) == 3  # 2.5 CPUs of time: three processes can use it
    assert usable_cores(unlimited) == 64
    monkeypatch.setattr(cores.os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    assert usable_cores(limited) == 2  # taskset -c 0,1 under a 2.5-CPU quota


def test_every_auto_count_follows_the_usable_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a 64-core host in a 3-CPU container: 2 workers (not 16), 1 warm-up reader (not 8),
    the writes in a thread (the child is for 4 cores or more)."""
    for module in (supervisor, jobs, engine_host):
        monkeypatch.setattr(module, "usable_cores", lambda: 3)
    assert supervisor.auto_workers() == 2
    assert jobs.shard_count(Settings(warmup_processes="auto")) == 1
    assert engine_host.lmdb_writer(Settings(lmdb_writer="auto")) == "thread"
    for module in (supervisor, jobs, engine_host):
        monkeypatch.setattr(module, "usable_cores", lambda: 16)
    assert supervisor.auto_workers() == 12
    assert jobs.shard_count(Settings(warmup_processes="auto")) == 8
    assert engine_host.lmdb_writer(Settings(lmdb_writer="auto")) == "process"


@pytest.mark.parametrize("name", ["FLEETCACHE_WORKERS", "FLEETCACHE_WARMUP_PROCESSES"])
@pytest.mark.parametrize("value", ["0", "-3"])
def test_a_process_count_below_one_is_refused_at_start(
    monkeypatch: pytest.MonkeyPatch, name: str, value: str
) -> None:
    """``FLEETCACHE_WARMUP_PROCESSES=0`` started a server whose every warm-up job then failed
    (no reader); the settings refuse it, naming the setting, as they do the other counts."""
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=name.removeprefix("FLEETCACHE_").lower()):
        Settings()
    monkeypatch.setenv(name, "2")
    assert getattr(Settings(), name.removeprefix("FLEETCACHE_").lower()) == 2


# -- where each process of a server runs (cpu_plan) -------------------------------------------


def test_auto_placement_gives_a_gpu_engine_and_its_device_child_cpus_of_their_own() -> None:
    """12 CPUs, one engine driving its GPU from a child: the engine process on the first two,
    the child on the third, everything else on the other nine."""
    plan = cores.cpu_plan("auto", [True], cpus=range(12), cores=12)
    assert plan.engine(0) == (0, 1) and plan.device(0) == (2,)
    assert plan.shared == tuple(range(3, 12))
    # two engines on 16 CPUs: three each, ten left
    two = cores.cpu_plan("auto", [True, True], cpus=range(16), cores=16)
    assert (two.engine(1), two.device(1), two.shared) == ((3, 4), (5,), tuple(range(6, 16)))
    assert "engine 0 on 0-1, its device child on 2" in two.describe()


@pytest.mark.parametrize(
    ("children", "cpus", "quota"),
    [
        ([True], 10, None),  # 7 left: fewer than MIN_SHARED_CPUS
        ([True], 64, 8),  # a cgroup quota of 8 CPUs on a 64-CPU host
        ([True], 64, 32),  # a quota of 32: other containers may share the first CPUs
        ([True] * 4, 16, None),  # four engines would leave 4
        ([False], 64, None),  # a CPU engine computes on the engine process's own threads
        ([True, False], 64, None),
        ([], 64, None),
    ],
)
def test_auto_placement_leaves_the_kernel_to_it_when_it_would_cramp_a_process(
    children: list[bool], cpus: int, quota: int | None
) -> None:
    plan = cores.cpu_plan("auto", children, cpus=range(cpus), cores=quota or cpus)
    assert plan == cores.NO_PLACEMENT and plan.engine(0) == plan.device(0) == plan.shared == ()
    assert plan.describe() == "CPU placement: none (the kernel's)"


def test_explicit_placement_and_off() -> None:
    plan = cores.cpu_plan("4-5/6", [True, True], cpus=[0, 1, 2, 3, 4, 5, 6, 7])
    assert plan.engine(0) == plan.engine(1) == (4, 5) and plan.device(1) == (6,)
    assert plan.shared == (0, 1, 2, 3, 7)
    assert cores.cpu_plan("4-5/6", [False], cpus=range(8)).device(0) == ()  # no child: none
    assert cores.cpu_plan("off", [True], cpus=range(64), cores=64) == cores.NO_PLACEMENT
    for outside in ("0/9", "0-6/7"):  # not this server's CPUs, or none left for the rest
        with pytest.raises(ValueError, match="leave some to the other processes"):
            cores.cpu_plan(outside, [True], cpus=range(8))


@pytest.mark.parametrize(
    ("value", "said"),
    [
        ("0-1", "auto, off or ENGINE_CPUS/DEVICE_CPUS"),
        ("0-1/2/3", "auto, off or ENGINE_CPUS/DEVICE_CPUS"),
        ("on", "auto, off or ENGINE_CPUS/DEVICE_CPUS"),
        ("a/1", "'a' is not a CPU or a range of CPUs"),
        ("3-1/4", "'3-1' is not a CPU or a range of CPUs"),
        ("0/0-99999999", "'0-99999999' is not a CPU"),  # not a range to build in memory
    ],
)
def test_a_placement_that_is_not_one_is_refused_naming_the_setting(value: str, said: str) -> None:
    with pytest.raises(ValueError, match="FLEETCACHE_CPU_PLACEMENT") as refused:
        Settings(cpu_placement=value)
    assert said in str(refused.value)


def test_a_plan_names_every_cpu_of_the_server_and_comes_back_from_json() -> None:
    """Warm-up jobs run on ``everything()``; a job reads the plan back from the run dir's
    spec file (JSON lists)."""
    plan = cores.cpu_plan("auto", [True], cpus=range(12), cores=12)
    assert plan.everything() == tuple(range(12))
    assert cores.CpuPlan.of(json.loads(json.dumps(dataclasses.asdict(plan)))) == plan
    spec = ChildSpec(Settings().model_dump(mode="json"), "/tmp/run", cpus=plan)
    assert ChildSpec(**json.loads(json.dumps(dataclasses.asdict(spec)))).cpus == plan


def test_the_server_places_only_engines_driving_a_gpu_from_a_child() -> None:
    """``auto``: torch on a GPU (its device child) is placed; a device child on the CPU, a
    CPU engine, or a fallback engine (on the engine process's threads) leave it to the
    kernel; the explicit form places what it is told."""
    twelve = range(12)
    gpu = supervisor.server_cpu_plan(Settings(engine="torch"), ("cuda:0",), lambda: 1, twelve)
    assert (gpu.engine(0), gpu.device(0)) == ((0, 1), (2,))
    default = supervisor.server_cpu_plan(Settings(engine="torch"), ("auto",), lambda: 1, twelve)
    assert default == gpu
    for settings, device in [
        (Settings(engine="fake", device_process="on"), "cpu"),  # a child on the CPU
        (Settings(engine="torch"), "cpu"),  # no child
        (Settings(engine="torch"), "auto"),  # no GPU visible (below)
        (Settings(engine="torch", fallback_engine="fake"), "cuda:0"),
        (Settings(engine="torch", cpu_placement="off"), "cuda:0"),
    ]:
        gpus = 0 if device == "auto" else 1
        placed = supervisor.server_cpu_plan(settings, (device,), lambda n=gpus: n, twelve)
        assert placed == cores.NO_PLACEMENT, settings
    told = Settings(engine="fake", device_process="on", cpu_placement="0/1")
    assert supervisor.server_cpu_plan(told, ("cpu",), lambda: 0, twelve).device(0) == (1,)


def test_cpu_lists_read_and_written_as_taskset_writes_them() -> None:
    assert cores.cpu_list("0-2,5, 7-8") == (0, 1, 2, 5, 7, 8)
    assert cores.cpu_text((0, 1, 2, 5, 7, 8)) == "0-2,5,7-8"
    assert cores.cpu_text((3,)) == "3"
