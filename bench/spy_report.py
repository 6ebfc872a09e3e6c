"""Where a server's processes spend their samples: a table per process from py-spy's raw
output (``py-spy record --subprocesses -f raw``, as ``serve_bench --profile`` writes it).

    python -m bench.spy_report PROFILE.txt [--top 12]

A process is named by the entry point found in its stacks (engine, index, worker, warm-up
job, warm-up shard, job starter, supervisor). For each: its samples per thread, then the
frames that hold the most samples by themselves (the leaf: CPU, or a wait when py-spy ran
with ``--idle``) and the innermost frames of this repository's code (inclusive: what our
code was doing or waiting on). Counts are samples; at ``-r 50`` one sample is 20 ms of one thread.
"""

from __future__ import annotations

import argparse
import re
from collections import Counter, defaultdict
from pathlib import Path

ROLES = (  # the first entry point found in a process's stacks names it
    ("shard_main", "warm-up shard"),
    ("device_main", "device child"),
    ("engine_main", "engine"),
    ("index_main", "index"),
    ("writer_main", "LMDB writer"),
    ("worker_main", "worker"),
    ("demo_main", "demo loader"),
    ("run_job", "warm-up job"),  # forked by the job starter: its stacks hold both
    ("starter_main", "job starter"),
)
FRAME = re.compile(r"^(?P<func>.*) \((?P<file>[^():]+):(?P<line>\d+)\)$")
PACKAGES = ("cache", "engines", "features", "indexes", "proxy")  # py-spy: paths from sys.path


def parse(path: Path) -> dict[str, list[tuple[list[str], int]]]:
    """``{process: [(frames, samples)]}``, the process being the innermost ``process`` entry."""
    stacks: dict[str, list[tuple[list[str], int]]] = defaultdict(list)
    for line in path.read_text(errors="replace").splitlines():
        body, _, count = line.rpartition(" ")
        if not body or not count.isdigit():
            continue
        parts = body.split(";")
        procs = [p for p in parts if p.startswith("process ")]
        frames = [p for p in parts if not p.startswith("process ")]
        pid = procs[-1].split(":", 1)[0].removeprefix("process ") if procs else "?"
        stacks[pid].append((frames, int(count)))
    return stacks


def role(stacks: list[tuple[list[str], int]]) -> str:
    names = {f.split(" (", 1)[0] for frames, _ in stacks for f in frames}
    return next((name for entry, name in ROLES if entry in names), "supervisor")


def thread_of(frames: list[str]) -> str:
    """A thread by its target: the frame after threading's bootstrap, else the main thread."""
    names = [f.split(" (", 1)[0] for f in frames]
    if "Thread.run" in names:
        after = names.index("Thread.run") + 1
        return names[after] if after < len(names) else "Thread.run"
    return "main"


def ours(frame: str) -> bool:
    match = FRAME.match(frame)
    return match is not None and match["file"].split("/", 1)[0] in PACKAGES


def report(path: Path, top: int) -> str:
    lines = [f"# {path.name}"]
    by_pid = parse(path)
    named = sorted(by_pid.items(), key=lambda kv: (role(kv[1]), kv[0]))
    for pid, stacks in named:
        total = sum(n for _, n in stacks)
        threads: Counter[str] = Counter()
        leaves: Counter[str] = Counter()
        inner: Counter[str] = Counter()
        for frames, n in stacks:
            threads[thread_of(frames)] += n
            leaves[frames[-1] if frames else "?"] += n
            mine = [f for f in frames if ours(f)]
            inner[mine[-1] if mine else "(no repo frame)"] += n
        lines.append(f"\n## {role(stacks)} (pid {pid}): {total} samples")
        lines.append("threads: " + ", ".join(f"{t} {n}" for t, n in threads.most_common(8)))
        for title, counts in (("leaf frames", leaves), ("innermost repo frames", inner)):
            lines += [f"\n| {title} | samples | share |", "|---|---|---|"]
            lines += [f"| `{f}` | {n} | {n / total:.0%} |" for f, n in counts.most_common(top)]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("profiles", nargs="+", type=Path)
    parser.add_argument("--top", type=int, default=12)
    args = parser.parse_args()
    for path in args.profiles:
        print(report(path, args.top))


if __name__ == "__main__":
    main()
