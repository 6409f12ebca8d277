"""Coop vs DTR in one pool, as Coop's paper compares them: the smallest pool each trains in, the overhead
at equal pools and the fragmentation (``bonsai bench heuristics``; :mod:`bonsai_core.bench.heuristics`
measures, this module writes the pages from the results).

    bonsai bench heuristics --out docs/heuristics --example   # about a minute here
    bonsai bench heuristics --page docs/results/heuristics.md [--report-only]  # and the page's studies: minutes

writes ``results.json``, ``table.md`` and ``coop_vs_dtr.html``/``.png`` to ``--out``; ``--example`` adds
``example.md`` (the worked example); ``--page`` runs the page's other studies too and writes
docs/results/heuristics.md. Every number the page states, and every ranking, is computed from the results;
its fixed prose only explains mechanisms.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

from bonsai_core.bench import common, dtr_variants, heuristics
from bonsai_core.bench.common import listing, median, pct
from bonsai_core.bench.heuristics import (DEFAULT_OUT, FACTORS, GPT2_SMALL_LABEL, MODEL_SIZES, POOL_VARIANTS,
                                          RECORD_PAGE, STEPS, VARIANTS, display, label_of)


# the files that decide what the page says (tests/test_docs.py checks their hash against the page's)
SOURCES = ["bonsai_core/bench/heuristics_page.py", "bonsai_core/bench/heuristics.py",
           "bonsai_core/bench/dtr_variants.py", "tests/real_models.py",
           common.template_source("heuristics")]
FAIL_BAR = 20  # the figure draws "does not train in this pool" as a hatched bar this far below zero


# -- the Coop-vs-DTR study's table, figure and example --------------------------------------------

def pool_cell(e: dict[str, Any], label: str) -> str:
    """``label``'s smallest pool in MiB, one decimal, without the unit (the tables' headers name it)."""
    b = e["smallest_budget"][label]
    return common.mib(b + e["adam_bytes"], 1, "") if b else "-"


def ratio(e: dict[str, Any], label: str) -> float | None:
    b, c = e["smallest_budget"][label], e["smallest_budget"]["coop"]
    return (b + e["adam_bytes"]) / (c + e["adam_bytes"]) if b and c else None


def best_pool_ratio(e: dict[str, Any]) -> float | None:
    """The smallest pool of the best DTR-in-the-pool variant, over coop's (None when either trains in none)."""
    rs = [r for r in (ratio(e, k) for k in POOL_VARIANTS) if r is not None]
    return min(rs) if rs else None


def pool_order(e: dict[str, Any]) -> str | None:
    """How coop's smallest pool compares with the best DTR-in-the-pool variant's: "coop smaller", "same"
    (within one step of the bisection, which cannot tell them apart) or "coop larger"; None when either
    trains in none."""
    coop, others = e["smallest_budget"]["coop"], [e["smallest_budget"][k] for k in POOL_VARIANTS]
    others = [b for b in others if b]
    if not coop or not others:
        return None
    gap = min(others) - coop
    return "same" if abs(gap) <= e["bisection_step"] else "coop smaller" if gap > 0 else "coop larger"


def both_trained(results: dict[str, Any], factor: float) -> list[tuple[str, dict, dict]]:
    """(graph, coop's run, dtr-pool's run) at ``factor`` x coop's smallest pool, where both train."""
    pools = [(label, e["equal_pools"].get(str(factor))) for label, e in results["models"].items()]
    return [(label, p["coop"], p["dtr-pool"]) for label, p in pools if p and p["coop"]["ok"] and p["dtr-pool"]["ok"]]


def headline(results: dict[str, Any]) -> dict[str, Any]:
    """How often and by how much coop's smallest pool is below the best DTR-in-the-pool variant's, and the
    overheads at equal pools where coop and dtr-pool both train."""
    entries = list(results["models"].values())
    best = [r for r in map(best_pool_ratio, entries) if r is not None]
    orders = [pool_order(e) for e in entries]
    out: dict[str, Any] = {"models": len(entries), "coop_smaller": orders.count("coop smaller"),
                           "coop_larger": orders.count("coop larger"),
                           "best_dtr_over_coop": [min(best), max(best)] if best else None,
                           "dtr_pool_over_coop": [r for r in (ratio(e, "dtr-pool") for e in entries) if r]}
    for f in FACTORS:
        rows = [e["equal_pools"][str(f)] for e in entries if str(f) in e["equal_pools"]]
        both = [(a, b) for _, a, b in both_trained(results, f)]
        compared = common.compare((None, a["overhead"], b["overhead"]) for a, b in both)
        out[str(f)] = {"both_run": len(both), "coop_lower": len(compared["lower"]),
                       "coop_higher": len(compared["higher"]),
                       "median_coop": common.median(a["overhead"] for a, _ in both),
                       "median_dtr_pool": common.median(b["overhead"] for _, b in both),
                       "dtr_pool_fails": sum(not p["dtr-pool"]["ok"] for p in rows if p["coop"]["ok"]),
                       "coop_fails": sum(not p["coop"]["ok"] for p in rows)}
    return out


def table(results: dict[str, Any]) -> str:
    """table.md: every graph's smallest pools, the equal pools and the headline."""
    return common.fill("heuristics_table", meta=results["meta"], steps=STEPS, headline=results["headline"],
                       factors=FACTORS, models=results["models"].values(), labels=list(VARIANTS), label_of=label_of,
                       pool_cell=pool_cell, ratio=ratio, best_pool_ratio=best_pool_ratio,
                       overhead_columns=[f"overhead {k}" for k in VARIANTS])


def figure(results: dict[str, Any]):
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    entries = list(results["models"].values())
    xs = [label_of(e["model"], e["options"]).replace(" --", "<br>--") for e in entries]
    titles = ["smallest pool, relative to coop's (lower is better; missing: none up to 1.5x the no-remat peak)"] + [
        f"overhead at {f:.1f}x coop's smallest pool (%; hatched bar below zero: does not train in it)" for f in FACTORS]
    fig = make_subplots(rows=1 + len(FACTORS), cols=1, shared_xaxes=True, vertical_spacing=0.04,
                        subplot_titles=titles)
    colours = dict(zip(VARIANTS, ["#1f77b4", "#d62728", "#ff7f0e", "#9467bd", "#7f7f7f"]))
    for label in VARIANTS:
        fig.add_trace(go.Bar(x=xs, y=[ratio(e, label) for e in entries], name=label, marker_color=colours[label],
                             legendgroup=label), row=1, col=1)
        for i, f in enumerate(FACTORS):
            ys, hatch = [], []
            for e in entries:
                r = e["equal_pools"].get(str(f), {}).get(label)
                ys.append(None if r is None else 100 * r["overhead"] if r["ok"] else -FAIL_BAR)
                hatch.append("" if r is None or r["ok"] else "x")
            fig.add_trace(go.Bar(x=xs, y=ys, name=label, marker=dict(color=colours[label], pattern_shape=hatch),
                                 legendgroup=label, showlegend=False), row=2 + i, col=1)
    fig.update_layout(barmode="group", width=1400, height=1300, template="plotly_white",
                      title=f"Coop vs DTR in one pool ({results['meta']['date']}; {results['meta']['command']})",
                      legend=dict(orientation="h", y=1.04, x=0))
    fig.update_yaxes(title_text="pool / coop's", row=1, col=1)
    return fig


def write_png(fig, path: Path) -> None:
    """The figure as PNG: a self-contained copy shot in headless Chromium, the browser the explorer's tests use
    (plotly's own PNG export needs kaleido, which the project does not install)."""
    chromium = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    if chromium is None:
        raise SystemExit("no chromium: cannot write the PNG (the HTML is written)")
    with tempfile.TemporaryDirectory() as tmp:
        page = Path(tmp) / "figure.html"
        fig.write_html(page, include_plotlyjs=True, config={"staticPlot": True})
        subprocess.run([chromium, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                        f"--window-size={fig.layout.width},{fig.layout.height}", f"--screenshot={path}",
                        page.as_uri()], check=True, capture_output=True, timeout=120)


def example_markdown(ex: dict[str, Any]) -> str:
    """example.md: the worked example's runs, their first differing requests, what each recomputes most
    and the sweep around the pool."""
    return common.fill("heuristics_example", ex=ex)


def write_beside(results: dict[str, Any], out: Path) -> None:
    """The headline into results.json, table.md, the figure; example.md when the results hold the example."""
    results["headline"] = headline(results)
    (out / "results.json").write_text(json.dumps(results, indent=1))
    (out / "table.md").write_text(table(results))
    fig = figure(results)
    fig.write_html(out / "coop_vs_dtr.html", include_plotlyjs="cdn")
    write_png(fig, out / "coop_vs_dtr.png")
    if "example" in results:
        (out / "example.md").write_text(example_markdown(results["example"]))


# -- the page: Coop against DTR in one pool -----------------------------------------------------------

def coop_vs_dtr_values(results: dict[str, Any]) -> dict[str, Any]:
    """What the Coop-against-DTR section says: the graphs, the tables, the fragmentation, the 2-layer GPT."""
    es = list(results["models"].items())
    small = results["models"].get(GPT2_SMALL_LABEL)
    return {"steps": STEPS, "factors": listing([f"{f:.1f}x" for f in FACTORS]),
            "networks": listing([f"`{m}`" for m in dict.fromkeys(e["model"] for _, e in es)]),
            "gpt2": f", and GPT-2 small (the zoo GPT at `zoo.GPT2_SMALL`, {small['nodes']:,} nodes)" if small else "",
            "graphs": len(es), "entries": es, "pool_columns": ["coop", *POOL_VARIANTS, "dtr"],
            "fragmentation": {name: fragmentation_counts(results, key) for name, key in
                              (("own", "own_fragmentation"), ("caching", "caching_fragmentation"))}}


def fragmentation_counts(results: dict[str, Any], key: str) -> list[tuple[float, int, int, float, float]]:
    """Per factor where both train: (factor, graphs where coop's fragmentation ``key`` is lower than
    dtr-pool's, graphs, coop's median, dtr-pool's median)."""
    out = []
    for f in FACTORS:
        both = both_trained(results, f)
        if both:
            lower = common.compare((g, c[key], d[key]) for g, c, d in both)["lower"]
            out.append((f, len(lower), len(both), median(c[key] for _, c, _ in both),
                        median(d[key] for _, _, d in both)))
    return out


# -- DTR's heuristics ------------------------------------------------------------------------------

FREE_MODE = ("dtr", "dtr_eq", "local", "lru", "size")  # the heuristics, each with deallocation `free`


def extremes(overheads: dict[str, list[float | None]], labels: Sequence[str], i: int) -> tuple[list[str], list[str]]:
    """The labels with the lowest and with the highest overhead at budget ``i`` (those that fit)."""
    values = {k: overheads[k][i] for k in labels if overheads[k][i] is not None}
    if not values:
        return [], []
    low, high = min(values.values()), max(values.values())
    return ([k for k, v in values.items() if abs(v - low) < 1e-9],
            [k for k, v in values.items() if abs(v - high) < 1e-9])


def ranking(part: dict[str, Any], labels: Sequence[str]) -> list[tuple[float, list[str], list[str], float, float]]:
    """At each budget where some fit: (budget, which of ``labels`` have the lowest overhead, the highest, those
    two overheads)."""
    o = part["overheads"]
    return [(f, low, high, o[low[0]][i], o[high[0]][i]) for i, f in enumerate(part["fracs"])
            for low, high in [extremes(o, labels, i)] if low]


def always(part: dict[str, Any], test: Callable[[int], bool]) -> bool:
    return all(test(i) for i in range(len(part["fracs"])))


def dtr_variants_said(part: dict[str, Any]) -> dict[str, Any]:
    """What the 2-layer GPT's table says about the heuristics, eager eviction and banishing."""
    o, fracs = part["overheads"], part["fracs"]
    evict, free, banish = o["dtr + evict"], o["dtr"], o["dtr + banish"]
    return {"o": o, "fracs": fracs, "same": always(part, lambda i: o["dtr"][i] == o["dtr_eq"][i]),
            "ranking": ranking(part, FREE_MODE), "lru": always(part, lambda i: "lru" in extremes(o, FREE_MODE, i)[1]),
            "ratios": always(part, lambda i: None not in (evict[i], free[i]) and evict[i] > free[i] > 0)
            and [evict[i] / free[i] for i in range(len(fracs))],
            "banish_lowest": [i for i in range(len(fracs)) if "dtr + banish" in extremes(o, list(o), i)[0]],
            "banish_fails": [f for f, x in zip(fracs, banish) if x is None]}


# -- does Coop's result reproduce? -----------------------------------------------------------------

def pool_comparison(results: dict[str, Any]) -> dict[str, list[tuple[str, float]]]:
    """Graphs by how the best DTR-in-the-pool variant's smallest pool compares with coop's
    (:func:`heuristics.pool_order`): (graph, best DTR / coop)."""
    out: dict[str, list[tuple[str, float]]] = {"coop smaller": [], "same": [], "coop larger": []}
    for label, e in results["models"].items():
        order = pool_order(e)
        if order is not None:
            out[order].append((label, best_pool_ratio(e)))
    return out


def live_comparison(results: dict[str, Any]) -> list[tuple[str, float]]:
    """(graph, dtr's smallest pool / coop's) where coop's is smaller than DTR counting live bytes by more
    than one bisection step."""
    return [(label, ratio(e, "dtr")) for label, e in results["models"].items() if e["smallest_budget"]["coop"]
            and e["smallest_budget"]["dtr"]
            and e["smallest_budget"]["dtr"] - e["smallest_budget"]["coop"] > e["bisection_step"]]


def times(r: float) -> str:
    """A ratio with two decimals, three where two would read 1.00."""
    return f"{r:.3f}x" if f"{r:.2f}" == "1.00" else f"{r:.2f}x"


def verdict(results: dict[str, Any]) -> str:
    """The bold answer's word: does coop's smaller pool, against DTR counting live bytes and against DTR in
    the pool, reproduce?"""
    graphs, live, pool = len(results["models"]), live_comparison(results), pool_comparison(results)
    smaller, larger = len(pool["coop smaller"]), len(pool["coop larger"])
    return ("Yes" if len(live) == graphs and not larger
            else "No" if len(live) <= graphs / 2 and smaller <= larger else "Partly")


def not_monotone(results: dict[str, Any]) -> tuple[str, str, int, int] | None:
    """An instance of a variant training in a pool and not in a larger one, when the results hold one:
    (variant, graph, the pool, the larger pool)."""
    for label, e in results["models"].items():
        for k in VARIANTS:
            runs = [(e["equal_pools"][str(f)]["budget"], e["equal_pools"][str(f)][k]) for f in FACTORS
                    if str(f) in e["equal_pools"]]
            for i, (small, a) in enumerate(runs):
                failed = [b for b, r in runs[i + 1:] if a["ok"] and not r["ok"]]
                if failed:
                    return k, label, small + e["adam_bytes"], failed[0] + e["adam_bytes"]
    return None


def equal_pools(results: dict[str, Any]) -> dict[str, Any]:
    """At each factor of coop's smallest pool, the headline counts and medians, the graphs where coop is dearer
    (its overhead and dtr-pool's) and those where neither recomputes; the factors where coop's is lower more often."""
    h = results["headline"]
    pools = [{**h[str(f)], "factor": f, "dearer": [(g, c["overhead"], d["overhead"]) for g, c, d in both
                                                   if c["overhead"] > d["overhead"] + 1e-9],
              "zero": sum(c["overhead"] == 0 == d["overhead"] for _, c, d in both)}
             for f in FACTORS for both in [both_trained(results, f)]]
    return {"pools": pools, "lower": [f for f in FACTORS if h[str(f)]["coop_lower"] > h[str(f)]["coop_higher"]]}


# -- the worked example ----------------------------------------------------------------------------

def divergence_values(ex: dict[str, Any]) -> dict[str, Any] | None:
    """The first request at which the two runs differ and each run's row there; None when they never do."""
    first = ex["first_divergence"]
    if first is None:
        return None
    coop, pool = (next(r for r in ex["requests"] if r["request"] == first + 1 and r["method"] == k)
                  for k in ("coop", "dtr-pool"))
    return {"first": first, "coop": coop, "pool": pool}


def sweep_values(ex: dict[str, Any]) -> dict[str, Any]:
    """The window's cost term against plain compute cost around the example's pool, and how much single
    budgets swing."""
    fracs, sw = ex["sweep_fracs"], ex["sweep"]
    plain, default = sw["coop window_cost=recompute"], sw["coop"]
    near = [j for j, f in enumerate(fracs) if abs(f - ex["frac"]) <= 0.05 + 1e-9]
    swing = {k: [sw[k][j] for j in near if sw[k][j] is not None] for k in ("coop", "dtr-pool")}
    return {"fracs": fracs, "sw": sw, "plain": plain, "i": fracs.index(ex["frac"]), "near": near,
            "cheaper": sum(p is not None and d is not None and p < d for p, d in zip(plain, default)),
            "plain_fails": [f"{f:.0%}" for f, x in zip(fracs, plain) if x is None],
            "ranges": [f"{k}'s from {pct(min(v))} to {pct(max(v))}" for k, v in swing.items() if v]}


def largest_graph(results: dict[str, Any]) -> dict[str, Any]:
    """The largest graph: its smallest pools against coop's and the overheads at coop's smallest pool."""
    label, e = max(results["models"].items(), key=lambda x: x[1]["nodes"])
    return {"label": label, "e": e, "best": best_pool_ratio(e), "order": pool_order(e),
            "at": e["equal_pools"].get(str(FACTORS[0]))}


# -- recomputable in-place -------------------------------------------------------------------------

# method -> (its in-place variant, its copy variant), in each study
UPDATE_PAIRS = {"coop": ("coop in place", "coop copy"), "dtr-pool": ("dtr-pool in place", "dtr-pool copy")}
WRITE_PAIRS = {"coop": ("coop writes in place", "coop copy-on-write"),
               "dtr-pool": ("dtr-pool writes in place", "dtr-pool copy-on-write")}


def by_model(rows: list[dict[str, Any]]) -> dict[str, dict[str, dict[str, Any]]]:
    """model -> variant -> its row, in the rows' order."""
    return common.cells(rows, lambda r: r["model"], by="variant")


def pair_split(rows: list[dict[str, Any]], pair: tuple[str, str],
               value: Callable[[dict], float | None]) -> dict[str, list[str]]:
    """The models where ``value`` of the in-place variant is lower than the copy's, higher, or equal
    (models where either has none left out)."""
    compared = common.compare((display(m), value(vs[pair[0]]), value(vs[pair[1]])) for m, vs in by_model(rows).items())
    return {k: [m for m, _ in compared[k]] for k in ("lower", "higher", "equal")}


def smallest_of(row: dict[str, Any]) -> float | None:
    return row["smallest"]


def overhead_at_80(row: dict[str, Any]) -> float | None:
    return row["at80"]["overhead"] if row["at80"]["ok"] else None


def pair_values(rows: list[dict[str, Any]], pairs: dict[str, tuple[str, str]]) -> list[tuple]:
    """Per method: the models where in place meets the smaller budget, where copying does, where they tie
    (:func:`pair_split`); the same of the overheads at 80%; and (in place or the copy, the models where only it
    trains at 80%)."""
    return [(method, pair_split(rows, pair, smallest_of), pair_split(rows, pair, overhead_at_80),
             [(who, models) for who, k, other in (("in place", *pair), ("the copy", *pair[::-1]))
              for models in [[display(m) for m, vs in by_model(rows).items()
                              if vs[k]["at80"]["ok"] and not vs[other]["at80"]["ok"]]] if models])
            for method, pair in pairs.items()]


def largest_gap(rows: list[dict[str, Any]], pairs: dict[str, tuple[str, str]]) -> tuple[float, str, str]:
    """(the largest gap between a model's in-place and copy budgets, the model, the method)."""
    return max((abs(vs[a]["smallest"] - vs[b]["smallest"]), display(m), method) for m, vs in by_model(rows).items()
               for method, (a, b) in pairs.items() if vs[a]["smallest"] and vs[b]["smallest"])


def mixed(rows: list[dict[str, Any]], pairs: dict[str, tuple[str, str]]) -> bool:
    """Whether in place wins the smallest budget on some model and the copy on another, for some method."""
    return any(all(pair_split(rows, pair, smallest_of)[k] for k in ("lower", "higher")) for pair in pairs.values())


def evictions_counts(rows: list[dict[str, Any]], pairs: dict[str, tuple[str, str]]) -> list[tuple[str, int, int, int]]:
    """Per method: (method, tensors evicted at 80% writing in place, copying on write, models where both train)."""
    out = []
    for method, (a, b) in pairs.items():
        both = [vs for vs in by_model(rows).values() if vs[a]["at80"]["ok"] and vs[b]["at80"]["ok"]]
        out.append((method, sum(vs[a]["at80"]["evictions"] for vs in both),
                    sum(vs[b]["at80"]["evictions"] for vs in both), len(both)))
    return out


def ops_in_place(rows: list[dict[str, Any]]) -> dict[str, int]:
    """Model (without its size) -> the ops its graph runs in place."""
    return {display(r["model"]).split(" --")[0]: r["inplace_ops"] for r in rows}


def span(values: Iterable[float | None]) -> float:
    """max - min of the values given (None left out), in percentage points."""
    xs = [x for x in values if x is not None]
    return 100 * (max(xs) - min(xs)) if xs else 0.0


def regnet_values(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """RegNet-Y: the table, how far the smallest budgets and the overheads move between the variants, and
    coop's fragmentation."""
    models = by_model(rows)
    budgets = {m: span(smallest_of(r) for r in vs.values()) for m, vs in models.items()}
    costs = {m: span(overhead_at_80(r) for r in vs.values()) for m, vs in models.items()}
    coop = WRITE_PAIRS["coop"]
    return {"regnet_ops": set(ops_in_place(rows).values()), "regnet_rows": by_model(rows),
            "regnet": {"budgets": budgets, "costs": costs, "far": max(budgets.values()) > 5 * max(costs.values()),
                       "frag": [(m, vs[coop[0]]["at80"]["own_fragmentation"], vs[coop[1]]["at80"]["own_fragmentation"])
                                for m, vs in models.items() if vs[coop[0]]["at80"]["ok"] and vs[coop[1]]["at80"]["ok"]]}}


# -- budgeting reserved bytes ----------------------------------------------------------------------

ALLOCATOR_NAMES = {"caching": "the caching allocator", "expandable": "expandable segments"}


def reserved_cost(b: dict[str, Any]) -> str:
    """The overhead budgeting reserved bytes adds at one budget, in points, per allocator model."""
    said = [f"{100 * (r['overhead'] - b['plain']['overhead']):+.1f} points of overhead with {ALLOCATOR_NAMES[k]}"
            for k, r in b["reserved"].items() if r["ok"]]
    refused = [ALLOCATOR_NAMES[k] for k, r in b["reserved"].items() if not r["ok"]]
    if refused:
        said.append(f"no schedule with {listing(refused)}")
    return f"at {b['frac']:.0%} " + listing(said)


def reserved_said(study: dict[str, Any]) -> dict[str, Any]:
    """The plain live-budget schedules replayed, what budgeting reserved bytes costs, how close expandable
    segments stay to the live peak, and how the solves ended."""
    budgets = study["budgets"]
    slack = [r["reserved_peak"] - r["live_peak"] for b in budgets for k, r in b["reserved"].items()
             if r["ok"] and k == "expandable"] + [b["plain"]["reserved"]["expandable"] - b["plain"]["live_peak"]
                                                  for b in budgets]
    solves = [b["plain"] for b in budgets] + [r for b in budgets for r in b["reserved"].values() if r["ok"]]
    over_budget = [[k for k, v in b["plain"]["reserved"].items() if v > b["budget"]] for b in budgets]  # replayed
    return {"budgets": list(zip(budgets, over_budget)), "cost": list(map(reserved_cost, budgets)), "slack": max(slack),
            "statuses": sorted({r["status"] for r in solves}),
            "gaps": [r["gap"] for r in solves if r.get("gap") is not None]}


# -- Coop's two claims --------------------------------------------------------------------------------

def claims_verdict(rows: list[dict[str, Any]], key: str) -> tuple[list[str], list[str]]:
    """(cells where coop's ``key`` is below dtr-pool's or dtr-pool does not train, the others)."""
    ahead, not_ahead = [], []
    for row in rows:
        coop, dtr = row["coop"], row["dtr-pool"]
        where = f"{row['model']} at {row['frac']:.0%}"
        won = coop["ok"] and (not dtr["ok"] or coop[key] < dtr[key])
        (ahead if won else not_ahead).append(where)
    return ahead, not_ahead


def with_whole_pool(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows with each run's fragmentation against the whole pool (``whole_pool``: 1 - its fullest
    moment's live bytes / the pool), the pool OneFlow reserves whole up front, instead of its high-water mark."""
    def run(r: dict[str, Any], pool: int) -> dict[str, Any]:
        return {**r, "whole_pool": 1.0 - r["live_peak"] / pool} if r["ok"] else r

    return [{**row, "coop": run(row["coop"], row["pool"]), "dtr-pool": run(row["dtr-pool"], row["pool"])} for row in rows]


def explained_by_first_request(row: dict[str, Any]) -> bool:
    """Whether coop's fullest moment is the one right before its first request that found no room and that request
    is larger than every byte of the pool not live then (no placement could serve it), the two runs being the same
    schedule up to it."""
    coop = row["coop"].get("fullest") or {}  # none kept where both runs tie
    first = coop.get("first_request")
    return not (first is None or row.get("same_until") != first["op"] or coop["op"] != first["op"] - 1
                or coop["free"] >= first["bytes"])


CLAIMS = {"overhead": "overhead", "own_fragmentation": "fragmentation in its own pool",
          "free_after_eviction": "free share of the pool once each eviction search has made room (the paper's rate)",
          "caching_fragmentation": "fragmentation replayed in PyTorch's caching allocator"}


def claims_values(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Coop's two claims together (less recomputation and less fragmentation than DTR in the same pool)
    at 60%, 70% and 80% of the no-remat peak: the table, where each claim holds, and the fullest moments of
    the cells where coop's own pool is not the less fragmented."""
    rows = with_whole_pool(rows)
    behind_in_own_pool = [r for r in rows if r["coop"]["ok"] and r["dtr-pool"]["ok"]
                          and r["coop"]["own_fragmentation"] >= r["dtr-pool"]["own_fragmentation"]]
    return {"claims": {"rows": rows, "verdicts": [(what, *claims_verdict(rows, key)) for key, what in CLAIMS.items()],
                       "failed": [f"{r['model']} at {r['frac']:.0%}" for r in rows if not r["dtr-pool"]["ok"]],
                       "whole_pool": claims_verdict(rows, "whole_pool"),
                       "fullest": [(r, explained_by_first_request(r)) for r in behind_in_own_pool]}}


# -- the page and the suite ------------------------------------------------------------------------

def page(results: dict[str, Any], header: str) -> str:
    """The whole page from one run's results (the study's, its worked example and the page's studies)."""
    s, ex = results["studies"], results["example"]
    small, larger, updates = s["dtr_variants"]["small"], s["dtr_variants"]["larger"], s["updates"]
    return common.fill(
        "heuristics", header=header, meta=results["meta"], **coop_vs_dtr_values(results), **claims_values(s["claims"]),
        small=small, small_table=dtr_variants.table(small), small_said=dtr_variants_said(small), larger=larger,
        larger_table=dtr_variants.table(larger), larger_ranking=ranking(larger, list(larger["overheads"])),
        verdict=verdict(results), equal=equal_pools(results), live=sorted(live_comparison(results), key=lambda x: x[1]),
        pool={k: sorted(v, key=lambda x: x[1]) for k, v in pool_comparison(results).items()},
        pool_variants=POOL_VARIANTS, not_monotone=not_monotone(results), times=times,
        example=ex, divergence=divergence_values(ex), sweep=sweep_values(ex), largest=largest_graph(results),
        update_models=[display(m) for m in by_model(updates)], updates=by_model(updates),
        updates_pairs=pair_values(updates, UPDATE_PAIRS), updates_mixed=mixed(updates, UPDATE_PAIRS),
        updates_gap=largest_gap(updates, UPDATE_PAIRS), writes_ops=ops_in_place(s["writes"]),
        writes=by_model(s["writes"]), writes_pairs=pair_values(s["writes"], WRITE_PAIRS),
        evictions=evictions_counts(s["writes"], WRITE_PAIRS), **regnet_values(s["regnet"]),
        study=s["reserved"], reserved=reserved_said(s["reserved"]), label_of=label_of, display=display,
        update_pairs=UPDATE_PAIRS, write_pairs=WRITE_PAIRS, pool_cell=pool_cell, ratio=ratio,
        best_pool_ratio=best_pool_ratio)


def add_arguments(ap: argparse.ArgumentParser) -> None:
    """The suite's options."""
    common.add_page_arguments(ap, DEFAULT_OUT, RECORD_PAGE)
    names = list(dict.fromkeys(n for n, _ in MODEL_SIZES))
    ap.add_argument("--models", nargs="+", default=names, help=f"from {', '.join(names)}")
    ap.add_argument("--time-limit", type=float, default=30.0, help="seconds per solve")
    ap.add_argument("--example", action="store_true", help="also write example.md (the worked example)")


def refusal(args: argparse.Namespace) -> str | None:
    """Why the options cannot run, before any measurement: a page from a subset of the models, a page
    again from results without the page's studies, or what :func:`common.page_refusal` refuses."""
    return common.page_refusal(args, narrowed=common.changed(args, ("models",)), whole="every model", studies=True)


def main(args: argparse.Namespace) -> int:
    """``bonsai bench heuristics``: the study, with ``--page`` the page's studies and the page."""
    return common.run_page_suite("heuristics", args, refusal(args), lambda: heuristics.measure(args),
                                 common.page_writer(page, SOURCES), write_beside)
