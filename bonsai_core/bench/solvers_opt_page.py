"""docs/results/checkmate_moccasin.md, written from one run of ``bonsai bench solvers-opt --page
docs/results/checkmate_moccasin.md`` (:mod:`bonsai_core.bench.solvers_opt`): the rows it measured (one
JSON line per graph, method and budget, each tagged with its study: ``main``, ``copies``, ``warm-start``)
and the run file beside them (command, dates, machine). :func:`page` writes the page from those alone:
every number it states, and every ranking or comparison, is computed from them; the fixed prose only
explains what the columns and statuses mean. The suite's table (:func:`table`) is here too."""

from __future__ import annotations

from typing import Any, Iterable, Sequence

from bonsai_core.bench import common
from bonsai_core.bench.common import capitalized, listing, pct, table
from bonsai_core.errors import BonsaiError

# the files that decide what the page says (tests/test_docs.py checks their hash against the page's)
SOURCES = ["bonsai_core/bench/solvers_opt_page.py", "bonsai_core/bench/solvers_opt.py"]
CHECKMATE = {"checkmate-highs": "HiGHS", "checkmate-scip": "SCIP"}  # the main table's checkmate rows: backend
WARM = {"checkmate-highs-warm": "HiGHS", "checkmate-scip-warm": "SCIP"}
BACKEND_OF = {**CHECKMATE, **WARM}
TIE = 1e-6  # overheads this close are the same cost
NO_BOUND = 0.9999  # a gap this large: the backend proved no bound above 0
NUMBER_WORDS = {2: "two", 3: "three", 4: "four", 5: "five", 6: "six"}

Row = dict[str, Any]


# -- one row ----------------------------------------------------------------------------------------

def outcome(row: Row) -> str:
    """What a row ended with, as the tables say it: optimal, feasible, infeasible (a BudgetError: the
    model proved no schedule fits), no solution in limit (a SolverError), killed, or the error's type."""
    if row["status"] != "error":
        return row["status"]
    error = row.get("error", "")
    if error.startswith("BudgetError"):
        return "infeasible"
    if error.startswith("SolverError") and ("no solution" in error or "found no" in error):
        return "no solution in limit"
    if error.startswith("killed"):
        return "killed"
    return error.split(":")[0] or "error"


def has_schedule(row: Row | None) -> bool:
    return row is not None and row["status"] in ("optimal", "feasible")


def cell_name(row: Row) -> str:
    return f"{row['graph']} at {share(row['budget_share'])}"


def share(fraction: float) -> str:
    return f"{fraction * 100:g}%"


def seconds(x: float) -> str:
    return f"{x:.1f}" if x < 10 else f"{x:.0f}"


def seconds_range(xs: Iterable[float]) -> str:
    """``1.0–6.6 s``, or ``4.5 s`` when they read the same."""
    xs = list(xs)
    lo, hi = seconds(min(xs)), seconds(max(xs))
    return f"{lo} s" if lo == hi else f"{lo}–{hi} s"


def count_range(xs: Iterable[int]) -> str:
    xs = list(xs)
    return f"{min(xs):,}" if min(xs) == max(xs) else f"{min(xs):,}–{max(xs):,}"


def graphs_said(graphs: Sequence[str], every: Sequence[str]) -> str:
    """``all four graphs`` when ``graphs`` are all of ``every`` (more than one), else their list."""
    if len(every) > 1 and set(graphs) == set(every):
        return f"all {NUMBER_WORDS.get(len(every), len(every))} graphs"
    return listing(list(graphs))


def cells_said(rows: Sequence[Row]) -> str:
    """``gpt-l2 at 70% and 50%, unet at 70%``: the rows' cells, grouped by graph."""
    by_graph: dict[str, list[str]] = {}
    for r in rows:
        by_graph.setdefault(r["graph"], []).append(share(r["budget_share"]))
    return listing([f"{g} at {listing(shares)}" for g, shares in by_graph.items()])


def start_overhead(row: Row) -> float | None:
    """The warm start's own overhead: its compute cost over the schedule's cost without recomputation."""
    if row.get("warm_start_cost") is None or row.get("compute_cost") is None:
        return None
    return row["warm_start_cost"] / (row["compute_cost"] / (1 + row["overhead"])) - 1


def start_method(row: Row) -> str | None:
    """The method the warm start came from (its note begins with it), None without one."""
    return row["warm_start"].split(",")[0] if row.get("warm_start_cost") is not None else None


def start_status(row: Row) -> str:
    """``optimal`` or ``feasible`` when the start's own search said so (moccasin and bonsai do), else ''."""
    note = (row.get("warm_start_tried") or {}).get(start_method(row) or "", "")
    return next((s for s in ("optimal", "feasible") if note.startswith(s)), "")


# -- the tables -------------------------------------------------------------------------------------

def runs_table(rows: Sequence[Row]) -> str:
    """One line per row: graph, budget, method, what it ended with, overhead, gap, model size and times."""
    def f(r: Row, key: str, fmt: str) -> str:
        return "" if r.get(key) is None else fmt.format(r[key])
    return table(["graph", "nodes", "budget", "method", "status", "overhead", "gap", "variables", "constraints",
                  "build s", "solve s"],
                 [[r["graph"], f(r, "nodes", "{}"), share(r["budget_share"]), r["method"], outcome(r),
                   f(r, "overhead", "{:.2%}"), f(r, "gap", "{:.2%}"), f(r, "variables", "{}"), f(r, "constraints", "{}"),
                   f(r, "build_seconds", "{:.2f}"), f(r, "solve_seconds", "{:.1f}")] for r in rows])


def in_cell_order(rows: Sequence[Row]) -> list[Row]:
    """The rows graph by graph, each graph's budgets largest first, the methods in the run's order
    within a budget (the run measures a method's budgets in turn)."""
    graphs, methods = graphs_of(rows), list(dict.fromkeys(r["method"] for r in rows))
    return sorted(rows, key=lambda r: (graphs.index(r["graph"]), -r["budget_share"], methods.index(r["method"])))


def graph_table(rows: Sequence[Row]) -> str:
    """Each graph once: nodes, those the models see (views contracted), edges, no-remat peak, the
    single-op lower bound."""
    return table(["graph", "nodes", "non-view nodes (model)", "edges", "no-remat peak", "single-op lower bound"],
                 [[r["graph"], r["nodes"], r["model_nodes"], r["edges"], f"{r['no_remat_peak']:,} B",
                   f"{r['peak_lower_bound']:,} B"] for r in first_per_graph(rows)])


def first_per_graph(rows: Sequence[Row]) -> list[Row]:
    """The first row of each graph that describes it (killed rows do not)."""
    first: dict[str, Row] = {}
    for r in rows:
        if "nodes" in r:
            first.setdefault(r["graph"], r)
    return list(first.values())


# -- moccasin, checkmate and the smallest budget: the sentences ---------------------------------------

def by_cell(rows: Sequence[Row]) -> dict[tuple[str, float], dict[str, Row]]:
    """(graph, budget share) -> method -> row."""
    out: dict[tuple[str, float], dict[str, Row]] = {}
    for r in rows:
        out.setdefault((r["graph"], r["budget_share"]), {})[r["method"]] = r
    return out


def graphs_of(rows: Sequence[Row]) -> list[str]:
    return list(dict.fromkeys(r["graph"] for r in rows))


def shares_of(rows: Sequence[Row]) -> list[float]:
    return list(dict.fromkeys(r["budget_share"] for r in rows))


def optimal_counts(rows: Sequence[Row]) -> dict[str, int]:
    methods = dict.fromkeys(r["method"] for r in rows)
    return {m: sum(r["method"] == m and r["status"] == "optimal" for r in rows) for m in methods}


def moccasin_lead(rows: Sequence[Row]) -> str:
    """How many cells each method proves optimal; moccasin called the practical exact method when it
    proves the most."""
    counts, cells = optimal_counts(rows), len(by_cell(rows))
    mine = counts.get("moccasin", 0)
    theirs = listing([f"{counts.get(m, 0)} on {backend}" for m, backend in CHECKMATE.items() if m in counts])
    sized = [r["variables"] for r in rows if r["method"] == "moccasin" and r.get("variables") is not None]
    name = "**moccasin**" + (f" ({count_range(sized)} variables)" if sized else "")
    lead = f"{name} is the practical exact method here" if mine > max(
        (counts.get(m, 0) for m in CHECKMATE), default=0) else name
    return f"{lead}: it proves {mine} of the {cells} graph × budget cells optimal, checkmate {theirs}."


def moccasin_optimal(rows: Sequence[Row]) -> str:
    """Where and how fast moccasin is optimal, budget by budget."""
    moc = [r for r in rows if r["method"] == "moccasin"]
    optimal = [r for r in moc if r["status"] == "optimal"]
    if not optimal:
        return ""
    every = graphs_of(moc)
    at = [f"at {share(s)} on {graphs_said([r['graph'] for r in optimal if r['budget_share'] == s], every)}"
          for s in shares_of(moc) if any(r["budget_share"] == s for r in optimal)]
    return f" It is optimal in {seconds_range(r['solve_seconds'] for r in optimal)} {listing(at)}."


def moccasin_rest(rows: Sequence[Row], limit: float) -> str:
    """Moccasin's other outcomes: a schedule at the limit, a proof of infeasibility, nothing."""
    moc = [r for r in rows if r["method"] == "moccasin"]
    feasible = [r for r in moc if r["status"] == "feasible"]
    infeasible = [r for r in moc if outcome(r) == "infeasible"]
    nothing = [r for r in moc if not has_schedule(r) and outcome(r) != "infeasible"]
    said = []
    if feasible:
        said.append(f"at the {seconds(limit)} s limit it returns a schedule without proving it on "
                    f"{cells_said(feasible)} (gap {gaps_said(feasible)})")
    if infeasible:
        said.append(f"with 2 copies per node it proves {cells_said(infeasible)} infeasible, each in "
                    f"{seconds(max(r['wall_seconds'] for r in infeasible))} s or less")
    if nothing:
        said.append(f"it finds no schedule within the limit on {cells_said(nothing)}")
    return "".join(f" {capitalized(s)}." for s in said)


def gaps_said(rows: Sequence[Row]) -> str:
    gaps = [r["gap"] for r in rows if r.get("gap") is not None]
    if not gaps:
        return "not reported"
    lo, hi = min(gaps), max(gaps)
    return f"{lo:.0%}" if f"{lo:.0%}" == f"{hi:.0%}" else f"{lo:.0%}–{hi:.0%}"


def copies_sentence(copies: Sequence[Row], main: Sequence[Row], limit: float) -> str:
    """What 3 copies per node give, graph by graph, and where they make a schedule fit that 2 could not."""
    if not copies:
        return ""
    budget = copies[0]["budget_share"]
    two = {r["graph"]: r for r in main if r["method"] == "moccasin" and r["budget_share"] == budget}
    found = [r for r in copies if has_schedule(r)]
    said = []
    if found:
        said.append("find a schedule for " + listing([f"{r['graph']} ({pct(r['overhead'])}, {r['status']})"
                                                      for r in found]))
    infeasible = [r["graph"] for r in copies if outcome(r) == "infeasible"]
    if infeasible:
        said.append(f"prove {listing(infeasible)} infeasible")
    nothing = [r["graph"] for r in copies if not has_schedule(r) and outcome(r) != "infeasible"]
    if nothing:
        said.append(f"find nothing within {seconds(limit)} s on {listing(nothing)}")
    rescued = [r["graph"] for r in found if r["graph"] in two and outcome(two[r["graph"]]) == "infeasible"]
    rescue = (f": 3 copies make a schedule fit where 2 were proven infeasible on {listing(rescued)}" if rescued
              else "")
    return f" At {share(budget)}, 3 copies per node {listing(said)}{rescue}."


def moccasin_bullet(main: Sequence[Row], copies: Sequence[Row], limit: float) -> str:
    return ("* " + moccasin_lead(main) + moccasin_optimal(main) + moccasin_rest(main, limit)
            + copies_sentence(copies, main, limit))


def checkmate_size(rows: Sequence[Row]) -> str:
    cm = [r for r in rows if r["method"] in CHECKMATE and r.get("variables") is not None]
    if not cm:
        return ""
    return (f" ({count_range(r['variables'] for r in cm)} variables, "
            f"{count_range(r['constraints'] for r in cm)} constraints)")


def checkmate_optimal(rows: Sequence[Row]) -> str:
    """Where checkmate is optimal, by which backends, and whether moccasin's optimum there costs the same."""
    cells = by_cell(rows)
    optimal = {key: [CHECKMATE[m] for m, r in c.items() if m in CHECKMATE and r["status"] == "optimal"]
               for key, c in cells.items()}
    optimal = {key: backends for key, backends in optimal.items() if backends}
    if not optimal:
        return " is solved to optimality in no cell."
    said = " is solved to optimality only on " + listing([f"{g} at {share(s)} ({listing(b)})"
                                                          for (g, s), b in optimal.items()]) + "."
    pairs = [(key, r, cells[key]["moccasin"]) for key in optimal for m, r in cells[key].items()
             if m in CHECKMATE and r["status"] == "optimal"
             and cells[key].get("moccasin", {}).get("status") == "optimal"]
    differ = [(key, r, moc) for key, r, moc in pairs if abs(r["overhead"] - moc["overhead"]) > TIE]
    if pairs and not differ:
        overheads = sorted({f"{moc['overhead']:+.2%}" for _, _, moc in pairs})
        said += (f" Where a backend and moccasin are both optimal their overheads match ({listing(overheads)}), as "
                 "they should where 2 computations per node suffice: with enough copies moccasin's model is "
                 "checkmate's.")
    elif differ:
        said += (" Where a backend and moccasin are both optimal the overheads differ on " + listing([
            f"{g} at {share(s)} ({CHECKMATE[r['method']]} {r['overhead']:+.2%} against {moc['overhead']:+.2%})"
            for (g, s), r, moc in differ]) + ".")
    return said


def against_moccasin(rows: Sequence[Row], after_optimal: bool) -> str:
    """Checkmate's schedules that are not proven: costlier or cheaper than moccasin's in the same cell,
    the widest difference as the example; and the runs it returns none in."""
    cells = by_cell(rows)
    unproven = [(r, cells[(r["graph"], r["budget_share"])].get("moccasin")) for r in rows
                if r["method"] in CHECKMATE and r["status"] == "feasible"]
    costlier = [(r, m) for r, m in unproven if has_schedule(m) and r["overhead"] > m["overhead"] + TIE]
    cheaper = [(r, m) for r, m in unproven if not has_schedule(m) or r["overhead"] < m["overhead"] - TIE]
    level = [(r, m) for r, m in unproven if (r, m) not in costlier and (r, m) not in cheaper]
    none = [r for r in rows if r["method"] in CHECKMATE and not has_schedule(r)]
    said = []
    if unproven:
        parts = []
        if costlier:
            r, m = max(costlier, key=lambda rm: rm[0]["overhead"] - rm[1]["overhead"])
            parts.append(f"costlier than moccasin's in {len(costlier)}, the widest difference on {cell_name(r)}: "
                         f"{CHECKMATE[r['method']]} {pct(r['overhead'])} against {pct(m['overhead'])}")
        if cheaper:
            parts.append(f"cheaper than moccasin's, or where moccasin has none, in {len(cheaper)}: "
                         + listing([f"{cell_name(r)}, {CHECKMATE[r['method']]} {pct(r['overhead'])}"
                                    + (f" against {pct(m['overhead'])}" if has_schedule(m) else "")
                                    for r, m in cheaper]))
        if level:
            parts.append(f"as cheap as moccasin's in {len(level)}: " + listing(
                [f"{cell_name(r)}, {CHECKMATE[r['method']]} {pct(r['overhead'])}" for r, _ in level]))
        said.append(f"an unproven schedule at the limit in {len(unproven)} runs"
                    + (f" ({'; '.join(parts)})" if parts else ""))
    if none:
        said.append(f"no schedule in {len(none)}")
    if not said:
        return ""
    return f" {'Elsewhere it' if after_optimal else 'It'} ends with {' and with '.join(said)}."


def backend_counts(rows: Sequence[Row]) -> str:
    """``SCIP returns a schedule in 9 of its 12 runs, HiGHS in 4``, the backend with more first."""
    counts = {backend: sum(r["method"] == m and has_schedule(r) for r in rows) for m, backend in CHECKMATE.items()}
    runs = {backend: sum(r["method"] == m for r in rows) for m, backend in CHECKMATE.items()}
    (first, a), (second, b) = sorted(counts.items(), key=lambda kv: -kv[1])
    if a == b:
        return f" HiGHS and SCIP each return a schedule in {a} of their {runs[first]} runs."
    return f" {first} returns a schedule in {a} of its {runs[first]} runs, {second} in {b}."


def checkmate_bullet(main: Sequence[Row]) -> str:
    any_optimal = any(r["method"] in CHECKMATE and r["status"] == "optimal" for r in main)
    return ("* **checkmate**" + checkmate_size(main) + checkmate_optimal(main) + against_moccasin(main, any_optimal)
            + backend_counts(main))


def smallest_budget_bullet(main: Sequence[Row], limit: float) -> str:
    """What checkmate returns at the smallest budget, against moccasin; the segment ILP's reason to exist
    when no backend proves an optimum there."""
    smallest = min(shares_of(main))
    cells = by_cell([r for r in main if r["budget_share"] == smallest])
    found = [(r, c.get("moccasin")) for c in cells.values() for m, r in c.items() if m in CHECKMATE and has_schedule(r)]
    at = share(smallest)
    gurobi = ("the open-source backends are far from what Checkmate's Gurobi runs needed, which is the segment "
              "ILP's reason to exist")
    if not found:
        return f"* At {at} checkmate returns no schedule on any graph within {seconds(limit)} s: {gurobi}."
    graphs = graphs_of([r for r, _ in found])
    only = "only " if len(graphs) < len(cells) else ""
    said = f"* At {at} checkmate returns a schedule {only}for " + listing([
        f"{g} (" + listing([f"{CHECKMATE[r['method']]}: {pct(r['overhead'])}" for r, _ in found if r["graph"] == g])
        + f", {against_moccasins(m)})" for g, m in {r["graph"]: m for r, m in found}.items()])
    no_optimum = not any(r["status"] == "optimal" for r, _ in found)
    gaps = [r["gap"] for r, _ in found if r.get("gap") is not None]
    if gaps and min(gaps) >= NO_BOUND:
        said += ", with no bound proven"
    elif gaps:
        said += f", the gap {gaps_said([r for r, _ in found])}" + (", none proven optimal" if no_optimum else "")
    return said + (f": {gurobi}." if no_optimum else ".")


def against_moccasins(row: Row | None) -> str:
    """``against moccasin's +19.8%``, or what moccasin ended with in that cell."""
    if row is None:
        return "moccasin not run"
    if has_schedule(row):
        return f"against moccasin's {pct(row['overhead'])}"
    return f"where moccasin is {outcome(row)}" if outcome(row) == "infeasible" else f"moccasin: {outcome(row)}"


# -- the warm start ---------------------------------------------------------------------------------

def warm_label(row: Row) -> tuple[str, str]:
    """(backend, warm start on/off) of a warm-start study's row."""
    return BACKEND_OF[row["method"]], "on" if row["method"] in WARM else "off"


def start_cell(row: Row) -> str:
    """When the start was ready, the method it came from and its overhead; ``off`` or ``none found``."""
    if row["method"] not in WARM:
        return "off"
    method = start_method(row)
    if method is None:
        return "none found"
    status = f" ({start_status(row)})" if start_status(row) else ""
    return f"{row['warm_start_seconds']:.1f} s: {method}{status}, {start_overhead(row):+.2%}"


def warm_table(rows: Sequence[Row]) -> str:
    return table(["backend", "warm start", "time limit", "start (ready at, from, its overhead)", "overhead", "gap",
                  "status", "call"],
                 [[*warm_label(r), f"{seconds(r['time_limit'])} s", start_cell(r), pct_cell(r.get("overhead")),
                   "" if r.get("gap") is None else f"{r['gap']:.2%}", outcome(r),
                   seconds(r["wall_seconds"]) + " s" if "wall_seconds" in r else ""] for r in rows])


def pct_cell(x: float | None) -> str:
    return "" if x is None else f"{x:+.2%}"


def warm_graph(rows: Sequence[Row]) -> str:
    """The study's graph and budget, and the size of the MILP the warm-started runs drive."""
    r = next(r for r in rows if "nodes" in r)
    sized = [x for x in rows if x["method"] in WARM and x.get("variables") is not None]
    milp = (f" The MILP the warm start drives has {sized[0]['variables']:,} variables and "
            f"{sized[0]['constraints']:,} constraints." if sized else "")
    return (f"The graph: {r['nodes']} nodes ({r['model_nodes']} in the model, views excepted), {r['edges']} edges, "
            f"no-remat peak {r['no_remat_peak']:,} B; {share(r['budget_share'])} is {r['budget']:,} B.{milp}")


def without_start(rows: Sequence[Row]) -> str:
    off = [r for r in rows if r["method"] in CHECKMATE]
    if not off:
        return ""
    if not any(has_schedule(r) for r in off):
        return (f"Without the warm start, no schedule within {listing(sorted({seconds(r['time_limit']) for r in off}))}"
                f" s on {'either backend' if len(off) > 1 else BACKEND_OF[off[0]['method']]}. ")
    return "Without the warm start, " + listing([
        f"{BACKEND_OF[r['method']]} ends {outcome(r)}" + (f" at {pct(r['overhead'])}" if has_schedule(r) else "")
        for r in off]) + f" within {seconds(off[0]['time_limit'])} s. "


def with_start(rows: Sequence[Row]) -> str:
    """Whether every warm-started run returns a schedule, how soon its start was ready, and from what."""
    on = [r for r in rows if r["method"] in WARM]
    if not on:
        return ""
    started = [r for r in on if start_method(r) is not None]
    returned = [r for r in on if has_schedule(r)]
    said = ("With it, every run returns a schedule within the budget" if len(returned) == len(on) else
            f"With it, {len(returned)} of the {len(on)} runs return a schedule within the budget")
    if started:
        methods = listing(sorted({start_method(r) for r in started}))
        said += (f", the start ready {seconds_range(r['warm_start_seconds'] for r in started)} into the call "
                 f"(from {methods})")
    missing = [r for r in on if start_method(r) is None]
    if missing:
        said += "; no start was found in the runs at " + listing([f"{seconds(r['time_limit'])} s on "
                                                                   f"{BACKEND_OF[r['method']]}" for r in missing])
    return said + ". "


def improvement(rows: Sequence[Row]) -> str:
    """Whether a backend improved on its start, and what the bound it proved says."""
    started = [r for r in rows if start_method(r) is not None and has_schedule(r)]
    if not started:
        return ""
    better = [r for r in started if r["compute_cost"] < r["warm_start_cost"] * (1 - TIE)]
    longest = max(r["time_limit"] for r in started)
    bounded = [r for r in started if r["time_limit"] == longest and r.get("gap") is not None]
    bound = (f"which after the full {seconds(longest)} s limit puts the recomputation cost at no less than "
             + listing([f"{1 - r['gap']:.0%} ({BACKEND_OF[r['method']]}'s bound)" for r in bounded])
             + " of the returned schedule's") if bounded else ""
    if not better:
        return ("Neither backend found a cheaper schedule than its start in any run: the MILP's value here is the "
                f"proven bound{', ' + bound if bound else ''}, not a better schedule. ")
    return ("The backend improved on its start in " + listing([
        f"the {BACKEND_OF[r['method']]} run at {seconds(r['time_limit'])} s ({pct(start_overhead(r))} to "
        f"{pct(r['overhead'])})" for r in better]) + (f"; the bound it proved: {bound}" if bound else "") + ". ")


def candidates(rows: Sequence[Row]) -> str:
    """What the start search found of each method, in the first warm-started run at the full limit."""
    full = [r for r in rows if r["method"] in WARM and r.get("warm_start_tried")]
    if not full:
        return ""
    r = max(full, key=lambda x: x["time_limit"])
    notes = "; ".join(f"`{m}`: {note}" for m, note in r["warm_start_tried"].items())
    return f"What the start search found (the {BACKEND_OF[r['method']]} run at {seconds(r['time_limit'])} s): {notes}. "


def limits_sentence(rows: Sequence[Row]) -> str:
    """How far the calls overran their limits, and what a shorter limit costs against the full one."""
    timed = [r for r in rows if "wall_seconds" in r]
    if not timed:
        return ""
    over = max(r["wall_seconds"] - r["time_limit"] for r in timed)
    said = (f"The calls overran their limit by at most {over:.1f} s." if over > 0 else
            "Every call ended within its limit.")
    longest = max(r["time_limit"] for r in rows)
    full = {r["method"]: r for r in rows if r["time_limit"] == longest and has_schedule(r)}
    shorter = [r for r in rows if r["time_limit"] < longest and r["method"] in full]
    for r in shorter:
        if not has_schedule(r):
            said += f" With a {seconds(r['time_limit'])} s limit, {BACKEND_OF[r['method']]} ends {outcome(r)}."
            continue
        points = 100 * (r["overhead"] - full[r["method"]]["overhead"])
        worse = (f"{abs(points):.1f} points of overhead {'worse' if points > 0 else 'better'} than"
                 if abs(points) >= 0.05 else "as cheap as")
        said += (f" With a {seconds(r['time_limit'])} s limit, {BACKEND_OF[r['method']]} returns in "
                 f"{seconds(r['wall_seconds'])} s with a schedule {worse} at {seconds(longest)} s.")
    return said


def warm_section(rows: Sequence[Row]) -> str:
    if not rows:
        return ""
    r = rows[0]
    title = f"### Checkmate's warm start on {r['graph']} at {share(r['budget_share'])}"
    prose = (without_start(rows) + with_start(rows) + improvement(rows) + candidates(rows) + limits_sentence(rows))
    return "\n\n".join([
        title, warm_graph(rows) + " Each row is one call of `solve(graph, budget, \"checkmate\", backend=..., "
        "warm_start=..., time_limit=...)` in its own process, what `bonsai solve G --method checkmate --budget P "
        "[--backend scip] [--time-limit S] [--option warm_start=false]` runs once the graph is loaded. \"start\" is "
        "the schedule the warm start handed the backend, its first incumbent: when it was ready from the start of "
        "the call (`warm_start_seconds`), the method it came from and that method's status, and its overhead; "
        "\"call\" is the call's wall time, the simulator's check included (Python start-up and graph loading not).",
        warm_table(rows), prose.strip()])


# -- the page ---------------------------------------------------------------------------------------

def load_said(run: dict[str, Any], rows: Sequence[Row]) -> str:
    """The load average at the end, and its range as the child processes ended (rows record it)."""
    loads = [r["load"] for r in rows if r.get("load") is not None]
    during = f", {min(loads):.1f} to {max(loads):.1f} as the solves ended" if loads else ""
    return f"load average at the end {run['load_end']:.1f}{during}"


def intro(run: dict[str, Any], rows: Sequence[Row], rows_link: str) -> str:
    v, run_file = run["versions"], run_link(rows_link)
    return (f"# `checkmate` and `moccasin`: measurements\n\nMachine: {run['machine']}; {load_said(run, rows)}. "
            f"torch {run['torch']}; HiGHS (highspy) {v['highspy']}, SCIP (PySCIPOpt) {v['pyscipopt']}, CP-SAT "
            f"(OR-Tools) {v['ortools']}, CVXPY {v['cvxpy']}. Date: {common.run_dates(run)} ({run['seconds'] / 60:.0f} "
            "minutes). The methods: [../SOLVERS_CHECKMATE_MOCCASIN.md](../SOLVERS_CHECKMATE_MOCCASIN.md).\n\n"
            f"Command (from the repository root):\n\n```\n{run['command']}\n```\n\n"
            "It ran the three studies below and wrote this page from their results alone: one row per graph, method "
            f"and budget in [{rows_link}]({rows_link}), the command, dates and machine beside it "
            f"([{run_file}]({run_file})). Model sizes and proven optima depend only on the code and "
            "the solvers' versions; what a run reaches within its time limit (status, gap, the schedule it returns) "
            "and the seconds also depend on the machine and its load, so they are indicative.")


def run_link(rows_link: str) -> str:
    return rows_link.rsplit(".", 1)[0] + ".run.json"


def main_intro(main: Sequence[Row], limit: float) -> str:
    graphs = listing(graphs_of(main))
    budgets = listing([share(s) for s in shares_of(main)])
    return (f"## The op-level solvers on zoo graphs\n\nThe suite traces each zoo graph ({graphs}; gpt-l1 and gpt-l2 "
            f"are `gpt` with `layers=1` and `layers=2`) at its default size, and for each method solves at {budgets} "
            f"of the no-remat peak with a {seconds(limit)} s time limit, each (graph, method) in its own process, the "
            "budgets in turn (so checkmate re-solves its cached model). `checkmate-highs` and `checkmate-scip` are "
            "Checkmate's MILP alone, with no warm start (`--option warm_start=false`, the CVXPY model); the warm "
            "start, checkmate's default, is the last study. Every schedule in the tables went through the simulator: "
            "its peak fits the budget and its overhead is the simulated one.")


DEFINITIONS = (
    "\"overhead\" is the simulated extra compute (compute cost / one computation of every node − 1); \"gap\" is "
    "relative to the recomputation cost (100%: the backend proved no bound above 0); \"no solution in limit\" is the "
    "`SolverError` a user gets; \"infeasible\" is the method's proof that no schedule fits (a `BudgetError`; for "
    "moccasin, none with at most its number of computations per node). \"build s\" is building the model; \"solve "
    "s\" includes CVXPY's canonicalisation on the first solve of a graph. Checkmate's MILP is large: a binary per "
    "(stage, node) pair for each of R and S and one per (stage, node, consumer) for FREE, O(n(n + edges)), where "
    "moccasin's has a few integer variables per copy of a node, O(copies × n), and reservoirs per edge.")


def copies_intro(copies: Sequence[Row], main: Sequence[Row]) -> str:
    budget = copies[0]["budget_share"]
    infeasible = [r["graph"] for r in main if r["method"] == "moccasin" and r["budget_share"] == budget
                  and outcome(r) == "infeasible"]
    where = f", where 2 copies were proven infeasible for {listing(infeasible)}" if infeasible else ""
    return f"Moccasin with 3 copies per node (`copies=3`) at {share(budget)}{where}:"


def page(rows: Sequence[Row], run: dict[str, Any], header: str, rows_link: str) -> str:
    """The whole page from one run: its rows and its run file; ``rows_link``: the rows' file as a link
    from the page."""
    main = [r for r in rows if r.get("study") == "main"]
    copies = [r for r in rows if r.get("study") == "copies"]
    warm = [r for r in rows if r.get("study") == "warm-start"]
    if not main:
        raise BonsaiError("The run has no rows of the main study to write a page from: run the suite with --page.")
    limit = run["time_limit"]
    parts = [header, intro(run, rows, rows_link), main_intro(main, limit), graph_table(rows), DEFINITIONS,
             runs_table(in_cell_order(main))]
    if copies:
        parts += [copies_intro(copies, main), runs_table(copies)]
    bullets = [moccasin_bullet(main, copies, limit), checkmate_bullet(main), smallest_budget_bullet(main, limit)]
    parts += ["What the numbers say:", "\n".join(bullets)]
    if warm:
        parts.append(warm_section(warm))
    return "\n\n".join(parts) + "\n"
