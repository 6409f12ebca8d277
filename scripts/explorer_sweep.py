"""The explorer's whole-slider sweep of one graph, in-process, timed position by position (issue 57).

    BONSAI_EXPLORER_CACHE=$(mktemp -d) python scripts/explorer_sweep.py GRAPH.json [--profile OUT]

As a session starts it (:mod:`explorer.ahead`): bonsai's solve at 70% with the sidebar's default time limit,
then every other slider position in the sweep's order, here in this thread rather than the server's
background one; then the pages' work the sweep puts off, timed apart: what this thread draws beside each plan,
and the child process's (:mod:`explorer.background`: FSDP replays, bonsai's reach), waited for; then
each position asked again as a drag asks it, its slowest answers printed. An empty cache folder measures a
first sweep (a folder already holding the plans measures a reopened model); ``--positions-only`` leaves the
put-off work out. ``--profile`` writes cProfile's statistics of the sweep, counted in this thread's CPU seconds
(what a solve's time limit counts: on a loaded machine wall seconds mostly measure the wait for a core), and
prints the 40 costliest calls. ``--record`` writes what each position answers (its plan's digest, peak and
overhead, or its error) as JSON, so that two sweeps' answers can be diffed.
"""

from __future__ import annotations

import argparse
import cProfile
import hashlib
import json
import os
import pstats
import resource
import time

from bonsai_core.graph import load_graph
from bonsai_core.schedule import no_remat_peak
from explorer import ahead, background, compute
from explorer.state import DEFAULT_TIME_LIMIT

FIRST = 70  # % of the no-remat peak: where the session's own solve is


def sweep_in_this_thread(sweep: ahead.Sweep, put_off: bool) -> tuple[dict[int, float], list[tuple[float, float]]]:
    """Run the sweep's work as the worker thread would: (seconds per position, (seconds, CPU seconds) per
    put-off job); ``put_off`` False drops the put-off work."""
    positions: dict[int, float] = {}
    later: list[tuple[float, float]] = []
    while (found := ahead._next()) is not None:
        _, p = found
        start, cpu = time.perf_counter(), time.process_time()
        if callable(p):
            if put_off:
                p()
                later.append((time.perf_counter() - start, time.process_time() - cpu))
            continue
        ahead._solve(sweep, p)
        positions[p] = time.perf_counter() - start
        print(f"  {p}%: {positions[p]:.2f} s (cpu {time.process_time() - cpu:.2f} s), ok={sweep.solved.get(p)}, "
              f"answered {sweep.known}", flush=True)
    return positions, later


def waited_for(sweep: ahead.Sweep) -> str:
    """Wait for the sweep's child process; its wall seconds since the positions were answered and its CPU
    seconds, in words."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    code = sweep.child.wait()
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    return (f"the child process (exit {code}) ended {time.perf_counter() - sweep.ended:.1f} s after the positions "
            f"were answered, cpu {cpu:.1f} s (niceness {background.NICENESS})")


def answers(graph, options, reference: int) -> dict[int, dict]:
    """What every slider position answers once the sweep is done: a plan's digest, peak and overhead, or its
    error."""
    out = {}
    for p in ahead.SLIDER:
        got = ahead.answer(graph, "bonsai", options, None, p) or compute.solve(graph, ahead.budget_at(p, reference),
                                                                             "bonsai", options)
        if got.ok:
            ops = json.dumps([[k, int(v)] for k, v in got.schedule.ops]).encode()
            out[p] = {"plan": hashlib.sha256(ops).hexdigest()[:16], "peak": int(got.sim.peak),
                      "overhead": round(float(got.sim.overhead), 9)}
        else:
            out[p] = {"error": got.error}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("graph")
    ap.add_argument("--profile", default=None, help="write cProfile's statistics of the sweep here")
    ap.add_argument("--record", default=None, help="write each position's answer here (JSON)")
    ap.add_argument("--positions-only", action="store_true", help="leave out the work the sweep puts off")
    args = ap.parse_args()
    graph = load_graph(args.graph)
    reference = no_remat_peak(graph)
    options = (("time_limit", DEFAULT_TIME_LIMIT),)
    start, cpu = time.perf_counter(), time.process_time()
    first = compute.solve(graph, ahead.budget_at(FIRST, reference), "bonsai", options)
    print(f"{graph.n} ops; first solve at {FIRST}%: {time.perf_counter() - start:.1f} s (cpu "
          f"{time.process_time() - cpu:.1f} s), {'a plan' if first.ok else 'no plan: ' + str(first.error)}", flush=True)
    ahead._wake = lambda: None  # no background thread: this one does the work
    ahead.start(graph, first, reference, FIRST)
    sweep = ahead.find(graph, "bonsai", options, None, FIRST)[0]
    profile = cProfile.Profile(time.thread_time) if args.profile else None
    if profile:
        profile.enable()
    cpu = time.process_time()
    _, later = sweep_in_this_thread(sweep, not args.positions_only)
    cpu = time.process_time() - cpu
    if profile:
        profile.disable()
    later_cpu = [c for _, c in later]
    print(f"every position answered after {sweep.seconds:.1f} s ({len(sweep.solved)} solved, {len(sweep.derived)} "
          f"below a failed one); the put-off work {sum(s for s, _ in later):.1f} s more ({len(later)} jobs, cpu "
          f"{sum(later_cpu):.1f} s, the longest {max(later_cpu, default=0.0):.1f} s); cpu {cpu:.1f} s in all, load "
          f"average {os.getloadavg()[0]:.1f}", flush=True)
    if args.record:
        with open(args.record, "w") as f:
            json.dump(answers(graph, options, reference), f, indent=1, sort_keys=True)
    if sweep.child is not None:
        print(waited_for(sweep), flush=True)
    asked = []
    for p in ahead.SLIDER:
        begun = time.perf_counter()
        budget = ahead.budget_at(p, reference)
        ahead.answer(graph, "bonsai", options, None, p) or compute.solve(graph, budget, "bonsai", options)
        asked.append((time.perf_counter() - begun, p))
    print("after the sweep, the slowest answers (s, %):", [(round(s, 3), p) for s, p in sorted(asked)[-3:]])
    if profile:
        profile.dump_stats(args.profile)
        pstats.Stats(args.profile).sort_stats("cumulative").print_stats(40)


if __name__ == "__main__":
    main()
