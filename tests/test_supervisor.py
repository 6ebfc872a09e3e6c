"""The supervisor's restart rules, on small stand-in processes (no server)."""

from __future__ import annotations

import multiprocessing
import threading
import time
from typing import Any

from proxy.settings import Settings
from proxy.supervisor import Slot, Supervisor

fork = multiprocessing.get_context("fork")


def _sleep_then_exit(seconds: float, code: int) -> None:
    time.sleep(seconds)
    raise SystemExit(code)


class Starts:
    """A slot's ``start``: each call makes the next of ``runs`` (seconds, exit code), the
    last one for as long as the test runs; ``at`` records when each started."""

    def __init__(self, *runs: tuple[float, int]) -> None:
        self.runs, self.at = list(runs), list[float]()

    def __call__(self) -> Any:
        seconds, code = self.runs.pop(0) if len(self.runs) > 1 else self.runs[0]
        self.at.append(time.monotonic())
        return fork.Process(target=_sleep_then_exit, args=(seconds, code), daemon=True)


def watch(index_starts: Starts, demo_starts: Starts, until: Any) -> tuple[Slot, Slot]:
    """The supervisor's watch loop over an index owner and a demo job until ``until(index,
    demo)`` holds (at most 20 s), then stopped; the two slots as they ended."""
    supervisor = Supervisor(Settings(), host="127.0.0.1", port=0, workers=0)
    index, demo = Slot("index", -1, index_starts), Slot("job", -1, demo_starts)
    supervisor.slots = [index, demo]
    board: Any = None  # neither slot is on a board (board_slot -1)
    for slot in supervisor.slots:
        supervisor._start(slot, board)
    thread = threading.Thread(target=supervisor._watch, args=(board, index, demo))
    thread.start()
    try:
        deadline = time.monotonic() + 20
        while not until(index, demo):
            assert time.monotonic() < deadline, (index_starts.at, demo_starts.at)
            time.sleep(0.05)
    finally:
        supervisor._stopping = True
        thread.join()
        for slot in supervisor.slots:
            if slot.process is not None:
                slot.process.kill()
                slot.process.join()
    return index, demo


def test_the_demo_job_runs_again_when_the_index_died_while_it_was_closing() -> None:
    """The demo job marked the index ready and was on its way out, exit code 0, when the
    index owner was killed: the new index owner must be marked ready too (a CI run saw it
    stay "fleet index loading" for ever)."""
    index_starts = Starts((0.2, 1), (60, 0))  # dies while the job still runs, then stays up
    demo_starts = Starts((0.6, 0))  # every run of the job ends well
    index, _ = watch(
        index_starts, demo_starts, lambda index, demo: len(index_starts.at) == 2 and not demo.wanted
    )
    # done only once a run of the job started after the index owner it marked
    assert len(demo_starts.at) >= 2
    assert demo_starts.at[-1] >= index_starts.at[-1]
    assert index.restarts == 1


def test_the_demo_job_is_done_once_when_the_index_stays_up() -> None:
    demo_starts = Starts((0.2, 0))
    until = time.monotonic() + 1.5  # long enough for a wrong second run to start
    watch(Starts((60, 0)), demo_starts, lambda index, demo: time.monotonic() > until)
    assert len(demo_starts.at) == 1
