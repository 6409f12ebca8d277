"""The work a sweep puts off (:mod:`explorer.ahead`), done in a child process at the lowest CPU priority and kept
on disk (:mod:`explorer.disk`): the allocator replay of every plan the sweep solved (what an FSDP rank's chart
draws) and bonsai's reach (the Solve page's note under its error: on torchtitan's 8B step the largest rung's
model is built for minutes). In the server's own process this work held the interpreter's lock between a
session's steps: a drag right after a sweep took 2.40 s, 1.42 s once it was done. The server reads what the
child wrote as it reads any plan kept on disk; what the child has not written yet, a page computes itself.

    python -m explorer.background JOB.json

JOB.json (:func:`start` writes it): the digest of the server's bonsai_core (a child whose sources differ, the
server's changed on disk since it started, does nothing: it would keep its own code's answers under the
server's), the graph's hash (its graph kept by :func:`explorer.disk.save_graph`), the method, the bound, the
plans to replay (options and budget of each, as :mod:`explorer.disk` keys them), and whether to find bonsai's
reach.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from bonsai_core.errors import BonsaiError
from bonsai_core.graph import Graph
from explorer import disk

NICENESS = 19  # the lowest priority: the child takes the CPU the server's sessions leave
REACH_SECONDS = 20.0  # bonsai's reach: the smallest-budget search's time limit


def start(graph: Graph, method: str, reserved: str | None, replays: list[tuple[tuple, int]],
          reach: bool) -> subprocess.Popen | None:
    """The child doing this work for ``graph``: the replays of the plans kept at ``replays`` ((options, budget)
    each) and, with ``reach``, bonsai's reach; None when there is nothing to do or the disk cannot hold the job."""
    if not replays and not reach:
        return None
    job = {"code": disk.code_digest(), "graph": graph.hash, "method": method, "reserved": reserved, "reach": reach,
           "replays": [[[[k, v] for k, v in options], budget] for options, budget in replays]}
    try:
        disk.save_graph(graph)
        path = disk.save_job(json.dumps(job).encode())
    except OSError:  # a full or read-only disk: the pages compute what they draw themselves
        return None
    return subprocess.Popen([sys.executable, "-m", "explorer.background", str(path)], stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
                            cwd=str(disk.ROOT))


def replay_plans(graph: Graph, method: str, reserved: str | None, plans: list[tuple[tuple, int]]) -> None:
    """Keep the allocator replay of the plan kept at each (options, budget) of ``plans`` (one replay per
    distinct plan: neighbouring budgets may share theirs)."""
    from bonsai_core.allocator import replay_as_solved

    done: dict[str, object] = {}
    for options, budget in plans:
        kept = disk.load_plan(graph.hash, method, options, reserved, budget)
        if kept is None or kept[0] is None:
            continue
        schedule = kept[0]
        if disk.load_replay(graph.hash, method, options, reserved, budget, schedule) is not None:
            continue
        digest = disk.plan_digest(schedule)
        if digest not in done:
            try:
                done[digest] = replay_as_solved(graph, schedule)
            except BonsaiError:  # the page says why when it replays the plan itself
                continue
        disk.save_replay(graph.hash, method, options, reserved, budget, schedule, done[digest])


def find_reach(graph: Graph) -> None:
    """Keep bonsai's reach and the checkpoint regions' bound (:func:`explorer.disk.save_reach`), the reach's
    time limit counted in this process's CPU seconds, as the server's solves count theirs."""
    from bonsai_core.regions import region_peak_bound
    from bonsai_core.solvers.bonsai import lowest_budget
    from bonsai_core.solvers.deadline import cpu_seconds

    try:
        with cpu_seconds():
            reach = lowest_budget(graph, time_limit=REACH_SECONDS)
    except BonsaiError:
        reach = None
    disk.save_reach(graph.hash, reach, tuple(region_peak_bound(graph)))


def main(argv: list[str] | None = None) -> int:
    os.nice(NICENESS)
    return run(Path((argv if argv is not None else sys.argv[1:])[0]))


def run(path: Path) -> int:
    """Do the job at ``path`` and remove it: 0 when done, 1 when its graph is gone or its code is not this one."""
    job = json.loads(path.read_text())
    graph = disk.load_graph(job["graph"])
    if graph is None or job["code"] != disk.code_digest():
        path.unlink(missing_ok=True)
        return 1
    plans = [(tuple((k, v) for k, v in options), budget) for options, budget in job["replays"]]
    replay_plans(graph, job["method"], job["reserved"], plans)
    if job["reach"]:
        find_reach(graph)
    path.unlink(missing_ok=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
