"""docs/results/benchmarks.md, written from one run of the default suite: ``bonsai bench --time-limit 10
--methods ... -o docs/bench --page docs/results/benchmarks.md`` measures every method and peer
(:mod:`bonsai_core.bench.methods`), then :func:`page` writes the page from its results.csv, reach.csv and
run.json alone: every number it states, and every ranking, is computed from them; the fixed prose only
explains mechanisms. ``--report-only`` writes it again from those files."""

from __future__ import annotations

import re
from typing import Any, Iterable, Sequence

from bonsai_core.bench.common import capitalized, listing, median, pct, run_dates
from bonsai_core.errors import BonsaiError

# the files that decide what the page says (tests/test_docs.py checks their hash against the page's)
SOURCES = ["bonsai_core/bench/benchmarks_page.py", "bonsai_core/bench/methods.py"]
TIE = 1e-9  # overheads this close are a tie (as results.md's bold and its counts take them)
OP_LEVEL = ("moccasin", "checkmate", "dtr", "coop")  # schedules of single ops, outside bonsai's plan space
SOLVER_OF = {"moccasin": "CP-SAT", "checkmate": "MILP"}
METHOD_NAMES = {"per-block": "per-block checkpointing", "torch-budget": "PyTorch's budget partitioner"}
# the suite's models (methods.FULL_MODELS, by their labels) that the prose names; tests/test_bench_page.py checks them
MODEL_NAMES = {"gpt:batch=8,heads=4,layers=4,seq=256,vocab=1024,width=256": "the 4-layer GPT",
               "gpt:layers=1,seq=64": "the 1-layer gpt", "gpt": "the default gpt",
               "gpt:batch=8,heads=12,layers=12,seq=512,vocab=50257,width=768": "GPT-2 small"}

Row = dict[str, Any]
Cell = dict[str, Row]  # one model at one budget: method -> its row


# -- words and numbers -----------------------------------------------------------------------------

def model_name(label: str) -> str:
    return MODEL_NAMES.get(label, label)


def method_name(method: str) -> str:
    return METHOD_NAMES.get(method, method)


def budget(fraction: float) -> str:
    return f"{fraction * 100:g}%"


def budgets_said(fractions: Sequence[float]) -> str:
    """``90/70/50%``."""
    return "/".join(f"{f * 100:g}" for f in fractions) + "%"


def share(row: Row, key: str) -> str:
    """``row[key]`` bytes as a share of the model's no-remat peak."""
    return f"{row[key] / row['no_remat_peak']:.1%}"


def priced(method: str, overhead: float) -> str:
    return f"{method_name(method)} {pct(overhead)}"


def fit_list(priced_methods: Sequence[tuple[str, float]]) -> str:
    """``dtr (+845.9%) fits``, ``dtr (+39.4%) and coop (+60.3%) fit``."""
    said = listing([f"{method_name(m)} ({pct(o)})" for m, o in priced_methods])
    return said + (" fits" if len(priced_methods) == 1 else " fit")


def digits_apart(a: float, b: float) -> int:
    """Decimals (2 to 4) that tell two overheads apart in percent."""
    return next((d for d in (2, 3, 4) if f"{a:+.{d}%}" != f"{b:+.{d}%}"), 4)


def pair_said(a: float, b: float) -> str:
    """``+4.94% vs +5.03%``, with a digit more while the two would read the same."""
    digits = digits_apart(a, b)
    return f"{a:+.{digits}%} vs {b:+.{digits}%}"


# -- the cells -------------------------------------------------------------------------------------

def cells_by_model(rows: Iterable[Row]) -> dict[str, dict[float, Cell]]:
    """model -> budget -> method -> row, in the order of the results (budgets largest first)."""
    out: dict[str, dict[float, Cell]] = {}
    for r in rows:
        out.setdefault(r["model"], {}).setdefault(r["budget_fraction"], {})[r["method"]] = r
    return out


def feasible(cell: Cell) -> dict[str, float]:
    """The overhead of every method and peer that fits, ``none`` aside (it fits only without a budget)."""
    return {m: r["overhead"] for m, r in cell.items() if r["feasible"] and m != "none"}


def fits(cell: Cell, method: str) -> bool:
    return method in feasible(cell)


def bonsai_cheapest(cell: Cell) -> bool:
    costs = feasible(cell)
    return "bonsai" in costs and costs["bonsai"] <= min(costs.values()) + TIE


def others(cell: Cell) -> list[tuple[str, float]]:
    """The methods besides bonsai that fit, cheapest first."""
    return sorted(((m, o) for m, o in feasible(cell).items() if m != "bonsai"), key=lambda mo: mo[1])


def below_bonsai(cell: Cell) -> list[tuple[str, float]]:
    """The methods cheaper than bonsai where it fits, cheapest first."""
    mine = feasible(cell).get("bonsai")
    return [] if mine is None else [(m, o) for m, o in others(cell) if o < mine - TIE]


def failure_status(row: Row) -> str | None:
    """The solver status a failed row's note reports (``UNKNOWN``), None when it names none."""
    found = re.search(r"\(status (\w+)\)", row.get("note") or "")
    return found[1] if found else None


def not_run(row: Row) -> bool:
    return (row.get("note") or "").startswith("not run")


def nodes(by_budget: dict[float, Cell]) -> int:
    return next(iter(next(iter(by_budget.values())).values()))["nodes"]


# -- the headline model -------------------------------------------------------------------------------

def gap_said(rows: Sequence[Row]) -> str:
    gaps = [r["gap"] or 0.0 for r in rows]
    return "each proven optimal" if max(gaps, default=0.0) <= TIE else f"gap ≤ {max(gaps):.1%}"


def cheapest_lead(label: str, by_budget: dict[float, Cell]) -> str:
    """Where bonsai is the cheapest on one model: budgets, its overheads, the solver gap."""
    cheap = [f for f, c in by_budget.items() if bonsai_cheapest(c)]
    fitting = [f for f, c in by_budget.items() if fits(c, "bonsai")]
    head = f"**{capitalized(model_name(label))} ({nodes(by_budget)} nodes): bonsai is the cheapest method "
    if not cheap:
        return head + "at no budget**."
    overheads = " / ".join(pct(by_budget[f]["bonsai"]["overhead"]) for f in cheap)
    gaps = gap_said([by_budget[f]["bonsai"] for f in cheap])
    if cheap == fitting and len(cheap) > 2:
        return (head + f"at every budget from {budget(cheap[0])} down to {budget(cheap[-1])}**: {overheads} at "
                f"{budgets_said(cheap)} ({gaps}).")
    return head + f"at {budgets_said(cheap)}**: {overheads} ({gaps})."


def others_at(fraction: float, cell: Cell) -> str:
    """What the other methods cost at one budget where bonsai fits."""
    rest = others(cell)
    if not rest:
        return f"at {budget(fraction)} only bonsai fits"
    if len(rest) == 1:
        return f"at {budget(fraction)} only bonsai and {method_name(rest[0][0])} ({pct(rest[0][1])}) fit"
    return f"at {budget(fraction)} the others cost: " + listing([priced(m, o) for m, o in rest])


def below_reach_at(fraction: float, cell: Cell, reach: Row | None) -> str:
    """Who fits at a budget bonsai does not meet."""
    where = f"at {budget(fraction)}" + (f", below bonsai's reach ({share(reach, 'bonsai')})," if reach and
                                        reach.get("bonsai") else "")
    rest = others(cell)
    if not rest:
        return f"{where} no method fits"
    return f"{where} only " + fit_list(rest)


def tight_budgets_sentence(by_budget: dict[float, Cell], reach: Row | None) -> str:
    """The other methods at the two smallest budgets bonsai meets, and who fits below them."""
    fitting = [f for f, c in by_budget.items() if fits(c, "bonsai")]
    below = [f for f, c in by_budget.items() if not fits(c, "bonsai") and (not fitting or f < fitting[-1])]
    parts = [others_at(f, by_budget[f]) for f in fitting[-2:]] + [below_reach_at(f, by_budget[f], reach)
                                                                 for f in below]
    return capitalized("; ".join(parts)) + "." if parts else ""


def no_schedule_sentence(method: str, by_budget: dict[float, Cell], time_limit: float) -> str:
    """``moccasin found no schedule within 10 s at any budget on this graph (CP-SAT status UNKNOWN).``
    when it ran at every budget and fitted at none; empty otherwise."""
    rows = [c[method] for c in by_budget.values() if method in c]
    if not rows or any(r["feasible"] or not_run(r) for r in rows):
        return ""
    statuses = sorted({s for s in map(failure_status, rows) if s})
    said = f" ({SOLVER_OF.get(method, 'solver')} status {'/'.join(statuses)})" if statuses else ""
    return (f"{capitalized(method_name(method))} found no schedule within {time_limit:g} s at any budget on this "
            f"graph{said}.")


def headline_bullet(label: str, by_budget: dict[float, Cell], reach: Row | None, time_limit: float) -> str:
    sentences = [cheapest_lead(label, by_budget), tight_budgets_sentence(by_budget, reach)]
    sentences += [no_schedule_sentence(m, by_budget, time_limit) for m in SOLVER_OF]
    return "* " + " ".join(s for s in sentences if s)


# -- smallest reachable budgets ----------------------------------------------------------------------

def reach_clause(r: Row) -> str:
    bonsai = share(r, "bonsai") if r.get("bonsai") else "-"
    chen = share(r, "chen") if r.get("chen") else "-"
    return f"{model_name(r['model'])} {bonsai} / {chen} / {share(r, 'lower_bound')}"


def unproven_said(reach: Sequence[Row], time_limit: float) -> str:
    """Where the min-peak MILP was not proven within the time limit."""
    open_ = [r for r in reach if r.get("bonsai_status") != "optimal"]
    if not open_:
        return f"The min-peak MILP is proven within the {time_limit:g} s on every model."
    found = [f"{model_name(r['model'])} ({share(r, 'bonsai') + ' found' if r.get('bonsai') else 'none found'}, "
             f"status {r.get('bonsai_status')})" for r in open_]
    return f"The min-peak MILP is proven within the {time_limit:g} s on every model but " + listing(found) + "."


def plan_reach(r: Row) -> int | None:
    """The smallest budget bonsai meets in a solve: its min-peak MILP's, or chen's (its fallback plans)."""
    values = [r[k] for k in ("bonsai", "chen") if r.get(k)]
    return min(values) if values else None


def heuristics_below(r: Row) -> list[str]:
    """dtr and coop where they meet a smaller budget than bonsai's and chen's: ``dtr 30.0%``."""
    plans = plan_reach(r)
    said = []
    for m in ("dtr", "coop"):
        if r.get(m) and (plans is None or r[m] < plans):
            bound = ", the per-op bound," if r[m] <= r["lower_bound"] else ""
            said.append(f"{m} {share(r, m)}{bound}")
    return said


def reach_bullet(reach: Sequence[Row], time_limit: float) -> str:
    lead = ("* **Smallest reachable budget** (share of the no-remat peak: bonsai's min-peak MILP / chen's lowest "
            "plan / the per-op bound): " + "; ".join(map(reach_clause, reach)) + ". " + unproven_said(reach, time_limit))
    below = [(r, heuristics_below(r)) for r in reach]
    below = [(r, said) for r, said in below if said]
    if not below:
        return lead + " Neither dtr nor coop meets a smaller budget than bonsai's and chen's on any model."
    return lead + (" DTR's and Coop's op-level eviction meet a smaller budget than bonsai's and chen's (bonsai "
                   "meets chen's too: Chen's plans are its fallback) on "
                   + listing([f"{model_name(r['model'])} ({listing(said)} against {share_of(r, plan_reach(r))})"
                              for r, said in below])
                   + (f"; bonsai's or chen's is the smallest on the other {len(reach) - len(below)}."
                      if len(below) < len(reach) else "."))


def share_of(r: Row, value: int | None) -> str:
    return "none" if value is None else f"{value / r['no_remat_peak']:.1%}"


# -- bonsai against the rest ---------------------------------------------------------------------------

def contested(models: dict[str, dict[float, Cell]]) -> list[tuple[str, float, Cell]]:
    """Every cell where bonsai ran and some method or peer fits."""
    return [(m, f, c) for m, by_budget in models.items() for f, c in by_budget.items() if "bonsai" in c and feasible(c)]


def plan_space_misses(cells: Sequence[tuple[str, float, Cell]]) -> list[str]:
    """Cells where chen or the per-block peer (plans in bonsai's space) fits and bonsai does not, or costs less."""
    misses = []
    for model, f, c in cells:
        costs = feasible(c)
        for rival in ("chen", "per-block"):
            if rival in costs and ("bonsai" not in costs or costs["bonsai"] > costs[rival] + TIE):
                misses.append(f"{model_name(model)} at {budget(f)} ({priced(rival, costs[rival])})")
    return misses


def runner_up(cell: Cell) -> str:
    rest = others(cell)
    if not rest:
        return "the only method that fits"
    level = [m for m, o in rest if o <= feasible(cell)["bonsai"] + TIE]
    return f"level with {listing(level)}" if level else f"next {priced(*rest[0])}"


def model_wins(label: str, by_budget: dict[float, Cell]) -> str:
    """``hf:bert at 90% (+1.4%, next moccasin +1.5%), 70% (...)``; where bonsai is not the cheapest, said so."""
    wins = [f"{budget(f)} ({pct(c['bonsai']['overhead'])}, {runner_up(c)})"
            for f, c in by_budget.items() if bonsai_cheapest(c)]
    return f"{model_name(label)}: " + (", ".join(wins) if wins else "at no budget")


def could_not_run(models: dict[str, dict[float, Cell]]) -> str:
    """``PyTorch's budget partitioner could not run on hf:gpt2 and hf:llama.``: methods or peers that failed on
    a whole model before any budget (a crash, not a budget they miss)."""
    failed: dict[str, list[str]] = {}
    for model, by_budget in models.items():
        for method in dict.fromkeys(m for c in by_budget.values() for m in c):
            notes = [c[method].get("note") or "" for c in by_budget.values() if method in c]
            if all(n.startswith("could not run") for n in notes):
                failed.setdefault(method, []).append(model_name(model))
    return " ".join(f"{capitalized(method_name(m))} could not run on {listing(ms)} (results.csv says why)."
                    for m, ms in failed.items())


def cells_bullet(models: dict[str, dict[float, Cell]], first: str) -> str:
    cells = contested(models)
    cheapest = sum(bonsai_cheapest(c) for _, _, c in cells)
    misses = plan_space_misses(cells)
    plans = ("in no cell does chen or per-block checkpointing (plans in bonsai's space) fit where bonsai does not, "
             "or cost less" if not misses else "chen or per-block checkpointing (plans in bonsai's space) fits "
             "where bonsai does not, or costs less, in " + listing(misses))
    return (f"* **Bonsai is the cheapest feasible method in {cheapest} of the {len(cells)} cells where any method "
            "fits** (a cell: a model × budget where some method or peer is feasible; cheapest: the lowest overhead "
            f"in results.csv, peers included, ties included), and {plans}. Where it is the cheapest on the other "
            "models (its overhead, then the next cheapest method): "
            + "; ".join(model_wins(m, b) for m, b in models.items() if m != first) + ". " + could_not_run(models)).rstrip()


def beaten_cells(models: dict[str, dict[float, Cell]]) -> list[tuple[str, float, Cell]]:
    return [(m, f, c) for m, f, c in contested(models) if below_bonsai(c)]


def beaten_by(winner: str, cells: Sequence[tuple[str, float, Cell]]) -> str:
    """``moccasin is cheaper by up to 1.7 points on resnet at 90% (+4.94% vs +5.03%), ...``"""
    mine = [(m, f, c) for m, f, c in cells if below_bonsai(c)[0][0] == winner]
    gaps = [c["bonsai"]["overhead"] - feasible(c)[winner] for _, _, c in mine]
    said = []
    for model, f, c in mine:
        mine_ = c["bonsai"]["overhead"]
        also = [f"{method_name(m)}'s {o:+.{digits_apart(o, mine_)}%}" for m, o in below_bonsai(c)[1:]]
        said.append(f"{model_name(model)} at {budget(f)} ({pair_said(feasible(c)[winner], c['bonsai']['overhead'])}"
                    + (f"; {listing(also)} also below bonsai" if also else "") + ")")
    return f"{method_name(winner)} is cheaper by up to {max(gaps) * 100:.2f} points on " + listing(said)


def unreached_cells(models: dict[str, dict[float, Cell]]) -> list[str]:
    """Cells where bonsai ran and does not fit but others do: ``mlp at 50% (checkmate +37.2%, gap 50.0%; dtr ...)``."""
    said = []
    for model, f, c in contested(models):
        if not fits(c, "bonsai"):
            priced_ = [priced(m, o) + (f", gap {c[m]['gap']:.1%}" if (c[m].get("gap") or 0) > TIE else "")
                       for m, o in others(c)]
            said.append(f"{model_name(model)} at {budget(f)} ({'; '.join(priced_)})")
    return said


def peer_below_eager(models: dict[str, dict[float, Cell]]) -> list[str]:
    """Budget-partitioner cells cheaper than the plain step: a compiled step, not a recompute saving."""
    return [f"{model_name(m)} at {budget(f)} ({pct(c['torch-budget']['overhead'])})"
            for m, by_budget in models.items() for f, c in by_budget.items()
            if fits(c, "torch-budget") and c["torch-budget"]["overhead"] < 0]


def not_best_bullet(models: dict[str, dict[float, Cell]]) -> str:
    beaten = beaten_cells(models)
    winners = list(dict.fromkeys(below_bonsai(c)[0][0] for _, _, c in beaten))
    parts = ["* **Where bonsai is not the best**: " + ("; ".join(beaten_by(w, beaten) for w in winners)
                                                        if beaten else "in no cell where it fits is another method cheaper")
             + "."]
    if any(w in OP_LEVEL for w in winners):
        parts.append("These are op-level schedules: a tensor recomputed twice, or a region only partly rebuilt, is "
                     "outside bonsai's checkpoint-plan space (and a time-limited search may land elsewhere on "
                     "another run).")
    unreached = unreached_cells(models)
    if unreached:
        parts.append("Below bonsai's reach, others still fit: " + "; ".join(unreached) + ".")
    eager = peer_below_eager(models)
    if eager:
        parts.append("PyTorch's budget partitioner costs less than the plain step on " + listing(eager)
                     + ": its compiled step executes fewer priced ops than the eager step it is compared with, "
                       "not a recompute saving.")
    return " ".join(parts)


# -- solver cost -----------------------------------------------------------------------------------

def ratio_range(values: Sequence[float]) -> str:
    """``67×–130×``; ``?×`` when there is nothing to compare."""
    if not values:
        return "?×"
    lo, hi = min(values), max(values)
    return f"{lo:.0f}×" if round(lo) == round(hi) else f"{lo:.0f}×–{hi:.0f}×"


def checkmate_proven(models: dict[str, dict[float, Cell]]) -> list[tuple[str, float, Row, Row]]:
    """(model, budget, checkmate's row, bonsai's) where checkmate proved optimality and bonsai fits."""
    return [(m, f, c["checkmate"], c["bonsai"]) for m, by_budget in models.items() for f, c in by_budget.items()
            if "checkmate" in c and c["checkmate"]["feasible"] and c["checkmate"]["status"] == "optimal"
            and fits(c, "bonsai")]


def checkmate_sentence(models: dict[str, dict[float, Cell]], time_limit: float) -> str:
    proven = checkmate_proven(models)
    if not proven:
        return f"checkmate's op-level MILP proved optimality in no cell within {time_limit:g} s"
    where = "; ".join(f"{model_name(m)} at {budgets_said([f for mm, f, _, _ in proven if mm == m])}"
                      for m in dict.fromkeys(m for m, *_ in proven))
    dearer = [f"{model_name(m)} at {budget(f)}: {(b['overhead'] - c['overhead']) * 100:.2g} points higher"
              for m, f, c, b in proven if b["overhead"] > c["overhead"] + 1e-6]
    cost = (f"the same cost in {len(proven) - len(dearer)} of the {len(proven)} cells"
            + (f" ({'; '.join(dearer)})" if dearer else "") + ",")
    speed = ratio_range([c["solve_seconds"] / b["solve_seconds"] for _, _, c, b in proven])
    size = ratio_range([c["variables"] / b["variables"] for _, _, c, b in proven if c["variables"] and b["variables"]])
    return (f"where checkmate's op-level MILP proved optimality within {time_limit:g} s ({where}), bonsai found "
            f"{cost} {speed} faster with {size} fewer variables")


def never_found(models: dict[str, dict[float, Cell]], method: str) -> tuple[list[str], list[str]]:
    """(models where ``method`` ran and fitted at no budget, models where it was not run)."""
    none, skipped = [], []
    for m, by_budget in models.items():
        rows = [c[method] for c in by_budget.values() if method in c]
        if rows and all(not_run(r) for r in rows):
            skipped.append(model_name(m))
        elif rows and not any(r["feasible"] for r in rows):
            none.append(model_name(m))
    return none, skipped


def found_sentence(method: str, models: dict[str, dict[float, Cell]], meta: dict[str, Any]) -> str:
    """``moccasin found a schedule in 12 of the 40 cells it ran; none at any budget on ...``"""
    rows = [c[method] for by_budget in models.values() for c in by_budget.values() if method in c]
    ran = [r for r in rows if not not_run(r)]
    if not ran:
        return ""
    none, skipped = never_found(models, method)
    limit = meta.get("node_limits", {}).get(method)
    return (f"{method} found a schedule within {meta['time_limit']:g} s in {sum(bool(r['feasible']) for r in ran)} "
            f"of the {len(ran)} cells it ran" + (f"; none at any budget on {listing(none)}" if none else "")
            + (f" (not run on {len(skipped)} model{'s' * (len(skipped) > 1)} over its {limit}-node limit)"
               if skipped and limit else ""))


def bonsai_times(models: dict[str, dict[float, Cell]]) -> str:
    timed = [(m, f, c["bonsai"]["solve_seconds"]) for m, by_budget in models.items() for f, c in by_budget.items()
             if fits(c, "bonsai") and c["bonsai"]["solve_seconds"] is not None]
    if not timed:
        return ""
    model, f, longest = max(timed, key=lambda t: t[2])
    return (f"bonsai's solves took a median {median(t for _, _, t in timed):.2f} s, the longest {longest:.1f} s "
            f"({model_name(model)} at {budget(f)})")


def solver_bullet(models: dict[str, dict[float, Cell]], meta: dict[str, Any]) -> str:
    parts = [checkmate_sentence(models, meta["time_limit"])]
    parts += [found_sentence(m, models, meta) for m in ("checkmate", "moccasin")]
    parts.append(bonsai_times(models))
    said = "; ".join(p for p in parts if p)
    return "* **Solver cost**: " + said[0].lower() + said[1:] + "."


# -- the page --------------------------------------------------------------------------------------

def intro(models: dict[str, dict[float, Cell]], meta: dict[str, Any], bench: str) -> str:
    cells = sum(len(b) for b in models.values())
    return (f"# Every method and peer, side by side: what the run shows\n\nMachine: {meta['machine']}, torch "
            f"{meta['torch']}. Date: {run_dates(meta)} ({meta['seconds'] / 60:.0f} minutes). "
            f"Command:\n\n```\n{meta['command']}\n```\n\nIt measured {len(models)} models, {cells} model × budget "
            f"cells in all; the command wrote the tables below and this page from their results. The tables: "
            f"[{bench}/results.md]({bench}/results.md) (overhead per model × budget × method, smallest reachable "
            f"budgets, where bonsai is not the best, solver cost); one row per cell with statuses, gaps, reserved "
            f"bytes and fragmentation: [{bench}/results.csv]({bench}/results.csv); the smallest budget each method "
            f"reaches: [{bench}/reach.csv]({bench}/reach.csv). What is measured and how: "
            f"[../BENCHMARKS.md](../BENCHMARKS.md).\n\n![overhead vs budget]({bench}/overhead_vs_budget.png)\n\n"
            f"![solve time vs graph size]({bench}/solve_time_vs_size.png)\n\n![peak vs budget]({bench}/peak_vs_budget.png)")


def page(rows: Sequence[Row], reach: Sequence[Row], meta: dict[str, Any], header: str, bench: str) -> str:
    """The whole page from one run: its rows (results.csv), reach (reach.csv) and run.json (``meta``);
    ``bench``: the output folder as a link from the page."""
    models = cells_by_model(rows)
    if not models:
        raise BonsaiError("The run has no results to write a page from: run the bench with --page first.")
    first = next(iter(models))
    reach_of = {r["model"]: r for r in reach}
    bullets = [headline_bullet(first, models[first], reach_of.get(first), meta["time_limit"]),
               reach_bullet(reach, meta["time_limit"]) if reach else "",
               cells_bullet(models, first), not_best_bullet(models), solver_bullet(models, meta)]
    return "\n\n".join([header, intro(models, meta, bench), "## What it shows",
                        "\n".join(b for b in bullets if b)]) + "\n"
