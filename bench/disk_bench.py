"""What a directory's disk takes with an fdatasync per commit: random 4 KiB pages (what LMDB's
commit of hashed keys writes: each new entry lands on a random leaf page) against the same
bytes written in one sequential run, per commit of ``--pages`` pages, in a file of
``--file-mb``. Prints pages a second (median and worst of ``--runs`` commits) for each
directory given, so that a store's write rate can be read against what its disk allows.

    python -m bench.disk_bench /tmp /dev/shm --runs 5

Not a test.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import tempfile
import time
from pathlib import Path

PAGE = 4096


def commit_rate(directory: Path, pages: int, file_pages: int, sequential: bool) -> float:
    """Pages a second of one commit: ``pages`` pages written, then one fdatasync."""
    fd, name = tempfile.mkstemp(dir=directory, prefix="disk-bench-")
    try:
        os.ftruncate(fd, file_pages * PAGE)  # sparse: the writes allocate, as LMDB's growing file
        os.fsync(fd)
        data = os.urandom(PAGE)
        if sequential:
            start = random.randrange(file_pages - pages)
            writes = [(data * pages, start * PAGE)]
        else:  # in page order, as LMDB writes its dirty pages
            chosen = sorted(random.sample(range(file_pages), pages))
            writes = [(data, page * PAGE) for page in chosen]
        began = time.perf_counter()
        for buffer, offset in writes:
            os.pwrite(fd, buffer, offset)
        os.fdatasync(fd)
        return pages / (time.perf_counter() - began)
    finally:
        os.close(fd)
        os.unlink(name)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("dirs", nargs="+", type=Path)
    parser.add_argument("--pages", type=int, default=4096, help="pages a commit")
    parser.add_argument("--file-mb", type=int, default=1024)
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    file_pages = args.file_mb * 2**20 // PAGE
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    print(
        f"# disk_bench {when}, {os.cpu_count()} cores: {args.pages} pages a commit, one "
        f"fdatasync each, in a {args.file_mb} MiB file, {args.runs} commits a row"
    )
    print("| dir | layout | pages/s (worst) | MB/s |")
    print("|---|---|---|---|")
    for directory in args.dirs:
        for sequential in (False, True):
            rates = [
                commit_rate(directory, args.pages, file_pages, sequential) for _ in range(args.runs)
            ]
            median = statistics.median(rates)
            layout = "sequential" if sequential else "random pages"
            print(
                f"| {directory} | {layout} | {median:,.0f} ({min(rates):,.0f}) "
                f"| {median * PAGE / 1e6:,.0f} |"
            )


if __name__ == "__main__":
    main()
