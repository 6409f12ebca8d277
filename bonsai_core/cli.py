"""The ``bonsai`` command (a contract: scripts and the explorer's export page call it).

Exit status: 0 on success; 1 on a user error (bad file, infeasible budget, unknown model), with a
one-paragraph message on stderr and no traceback; 2 on bad arguments (argparse's convention).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any, Sequence

from bonsai_core.budget import Budget, format_bytes, parse_budget
from bonsai_core.errors import BonsaiError, BudgetError

# Size options any zoo model may take (each model accepts its own subset; see `bonsai zoo`).
MODEL_OPTIONS = ("batch", "seq", "layers", "width", "heads", "vocab", "image")


def _budget_arg(text: str) -> Budget:
    try:
        return parse_budget(text)
    except BudgetError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive number of seconds")
    return value


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive whole number")
    return value


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    """MODEL and its size options, shared by trace, export and verify."""
    p.add_argument("model", metavar="MODEL", help="a zoo name, hf:ARCH or hf:PATH/config.json (see `bonsai zoo`), or package.module:factory")
    for name in MODEL_OPTIONS:
        p.add_argument(f"--{name}", type=_positive_int, default=None, metavar="N", help=f"model option {name}")
    p.add_argument("--seed", type=int, default=0, help="seed for weights and the example batch (default 0)")


def model_options(args: argparse.Namespace) -> dict[str, int]:
    return {k: getattr(args, k) for k in MODEL_OPTIONS if getattr(args, k) is not None}


def _write_json(path: str, payload: dict[str, Any]) -> None:
    try:
        Path(path).write_text(json.dumps(payload, separators=(",", ":")) + "\n")
    except OSError as e:
        raise BonsaiError(f"Cannot write {path!r}: {e.strerror}. Check that its folder exists and is writable.") from None


# -- verbs ---------------------------------------------------------------------------------------

def cmd_zoo(args: argparse.Namespace) -> int:
    from bonsai_core.hf import ARCHS, PREFIX
    from bonsai_core.zoo import ZOO

    entries = {**ZOO, **{PREFIX + name: e for name, e in ARCHS.items()}}
    if args.json:
        print(json.dumps({name: {"description": e.description, "options": e.options} for name, e in entries.items()}))
        return 0
    for name, entry in entries.items():
        opts = " ".join(f"--{k} {v}" for k, v in entry.options.items())
        print(f"{name:11s} {entry.description}\n            {opts}")
    print(f"{PREFIX}PATH     a Hugging Face config.json (or its folder): causal LM, masked LM or image classification\n"
          "            --batch 8, and --seq (text, default min(128, positions)) or --image (vision, the config's)")
    return 0


def cmd_trace(args: argparse.Namespace) -> int:
    from bonsai_core.graph import save_graph
    from bonsai_core.schedule import no_remat_peak
    from bonsai_core.trace import trace_zoo

    traced = trace_zoo(args.model, profile=args.cost_model, seed=args.seed, **model_options(args))
    g = traced.graph
    try:
        save_graph(g, args.output)
    except OSError as e:
        raise BonsaiError(f"Cannot write {args.output!r}: {e.strerror}.") from None
    summary = {**g.summary(), "no_remat_peak": no_remat_peak(g), "trace_seconds": traced.seconds,
               "cost_model": args.cost_model}
    if args.json:
        print(json.dumps(summary))
    else:
        print(f"traced {g.name}: {g.n} nodes ({summary['forward_nodes']} forward), {g.num_edges} edges in "
              f"{traced.seconds:.2f} s; no-remat peak {format_bytes(summary['no_remat_peak'])}, fixed "
              f"{format_bytes(g.fixed_mem)}; wrote {args.output}")
    return 0


def cmd_solve(args: argparse.Namespace) -> int:
    from bonsai_core.graph import load_graph
    from bonsai_core.schedule import no_remat_peak
    from bonsai_core.solvers import solve

    g = load_graph(args.graph)
    reference = no_remat_peak(g)
    budget = args.budget.resolve(reference)
    options = {k: v for k, v in (("granularity", args.granularity), ("backend", args.backend),
                                 ("time_limit", args.time_limit)) if v is not None}
    schedule = solve(g, budget, method=args.method, **options)
    _write_json(args.output, schedule.to_dict())
    stats = {"method": args.method, "budget": budget, "no_remat_peak": reference, **schedule.stats}
    if args.json:
        print(json.dumps(stats))
    else:
        print(f"{args.method} on {g.name} under {format_bytes(budget)} ({budget / reference:.0%} of the no-remat "
              f"peak): peak {format_bytes(stats['peak'])}, overhead {stats['overhead']:+.2%}, status "
              f"{stats.get('status', '?')}, solved in {stats.get('solve_seconds', 0):.2f} s; wrote {args.output}")
    return 0


def cmd_simulate(args: argparse.Namespace) -> int:
    from bonsai_core.graph import load_graph
    from bonsai_core.schedule import load_schedule, simulate

    g = load_graph(args.graph)
    schedule = load_schedule(args.schedule)
    sim = simulate(g, schedule)
    stats = {"graph": g.name, "method": schedule.method, "budget": schedule.budget, **sim.stats(),
             "feasible": sim.feasible(schedule.budget), "ops": len(schedule.ops)}
    if args.allocator:
        from bonsai_core.allocator import replay

        stats.update(replay(g, schedule).stats())
    if args.json:
        print(json.dumps(stats))
    else:
        fits = "" if schedule.budget is None else (" (within budget)" if stats["feasible"] else " (OVER budget)")
        print(f"{schedule.method} schedule on {g.name}: {len(schedule.ops)} ops, peak {format_bytes(sim.peak)}{fits}, "
              f"compute {sim.compute_cost:.6g} s, overhead {sim.overhead:+.2%}, {sim.recomputes} recomputations")
        if args.allocator:
            print(f"caching allocator: reserved peak {format_bytes(stats['reserved_peak'])} in {stats['segments']} "
                  f"segment(s), fragmentation {stats['fragmentation']:.1%} at the reserved peak")
    return 0


def _fraction_arg(text: str) -> float:
    value = _budget_arg(text if text.strip().endswith("%") else text + "%")
    if value.fraction is None:
        raise argparse.ArgumentTypeError(f"{text!r}: bench budgets are shares of the no-remat peak, like 70 or 70%")
    return value.fraction


def cmd_bench(args: argparse.Namespace) -> int:
    from bonsai_core import bench
    from bonsai_core.peers import PEERS
    from bonsai_core.solvers import METHODS

    methods = args.methods or list(METHODS)
    peers = args.peers if args.peers is not None else list(PEERS)
    for m in methods:
        if m not in METHODS:
            raise BonsaiError(f"Unknown method {m!r}; choose from: {', '.join(METHODS)}.")
    for p in peers:
        if p not in PEERS:
            raise BonsaiError(f"Unknown peer {p!r}; choose from: {', '.join(PEERS)}.")
    config = bench.BenchConfig(
        models=args.models or list(bench.QUICK_MODELS if args.quick else bench.FULL_MODELS),
        budgets=args.budgets or list(bench.QUICK_BUDGETS if args.quick else bench.FULL_BUDGETS),
        methods=methods, peers=peers,
        time_limit=args.time_limit or (10.0 if args.quick else 60.0), backend=args.backend,
        max_nodes=dict(bench.BENCH_NODE_LIMITS))
    rows = bench.run_bench(config, args.output, progress=lambda line: print(line, flush=True))
    print(f"wrote {len(rows)} rows to {args.output}/results.csv, results.md and plots")
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from bonsai_core.export import export_model
    from bonsai_core.schedule import load_schedule

    schedule = load_schedule(args.schedule)
    out = export_model(args.model, model_options(args), schedule, args.output, seed=args.seed)
    opts = "".join(f" --{k} {v}" for k, v in model_options(args).items())
    print(f"exported {args.model} with its {schedule.method} schedule to {out} (checkpointed.py, schedule.json, "
          f"README.md); check it with: bonsai verify {args.model}{opts} {out}")
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    from bonsai_core.export import verify_export

    v = verify_export(args.model, model_options(args), args.dir, device=args.device, seed=args.seed, grads=args.grads)
    ok = v.loss_diff <= args.atol and v.max_grad_diff <= args.atol and v.peak_error <= 0.10
    if args.json:
        print(json.dumps({**v.to_dict(), "ok": ok}))
    else:
        print(f"on {v.device}: loss {v.loss_exported:.6g} (original {v.loss_original:.6g}, difference {v.loss_diff:.3g}); "
              f"largest gradient difference {v.max_grad_diff:.3g}\npeak: predicted {format_bytes(v.predicted_peak)}, "
              f"measured {format_bytes(v.measured_peak)} ({v.peak_error:+.2%}); original model "
              f"{format_bytes(v.original_peak)}\n{'OK' if ok else 'MISMATCH'}")
    return 0 if ok else 1


def cmd_app(args: argparse.Namespace) -> int:
    app = Path(__file__).resolve().parent.parent / "explorer" / "app.py"
    if not app.is_file():
        raise BonsaiError(f"The explorer is not installed next to bonsai_core ({app} is missing): run "
                          "`streamlit run explorer/app.py` from a checkout of the project.")
    os.execvp(sys.executable, [sys.executable, "-m", "streamlit", "run", str(app), *args.streamlit_args])
    return 0  # not reached


def build_parser() -> argparse.ArgumentParser:
    from bonsai_core.solvers import METHODS

    parser = argparse.ArgumentParser(prog="bonsai", description="Optimal tensor rematerialization explorer.")
    sub = parser.add_subparsers(dest="verb", required=True, metavar="VERB")

    p = sub.add_parser("zoo", help="list built-in models and their options")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_zoo)

    p = sub.add_parser("trace", help="trace a model's training step into a bonsai-graph JSON")
    add_model_arguments(p)
    p.add_argument("--cost-model", default="h100", choices=_profiles(), help="device profile for op costs")
    p.add_argument("-o", "--output", required=True, metavar="GRAPH.json")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.set_defaults(func=cmd_trace)

    p = sub.add_parser("solve", help="find a rematerialization schedule under a memory budget")
    p.add_argument("graph", metavar="GRAPH.json")
    p.add_argument("--budget", required=True, type=_budget_arg,
                   help="bytes (123456789), with a unit (800MiB, 2.5GB) or a share of the no-remat peak (60%%)")
    p.add_argument("--method", default="none", choices=list(METHODS))
    p.add_argument("--granularity", type=_positive_int, default=None, help="largest segment size (bonsai)")
    p.add_argument("--backend", choices=("highs", "scip"), default=None, help="MILP backend")
    p.add_argument("--time-limit", type=_positive_float, default=None, metavar="S", help="solver time limit, seconds")
    p.add_argument("-o", "--output", required=True, metavar="SCHEDULE.json")
    p.add_argument("--json", action="store_true", help="print the stats as one JSON object")
    p.set_defaults(func=cmd_solve)

    p = sub.add_parser("simulate", help="replay a schedule and report its peak memory and cost")
    p.add_argument("graph", metavar="GRAPH.json")
    p.add_argument("schedule", metavar="SCHEDULE.json")
    p.add_argument("--allocator", action="store_true",
                   help="also replay through the caching-allocator model: reserved peak and fragmentation")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_simulate)

    p = sub.add_parser("bench", help="every method and peer on the same models and budgets: tables and plots")
    p.add_argument("--models", nargs="+", metavar="MODEL", help="zoo models, e.g. gpt or gpt:layers=2,width=256")
    p.add_argument("--budgets", nargs="+", type=_fraction_arg, metavar="PCT", help="shares of the no-remat peak")
    p.add_argument("--methods", nargs="+", metavar="METHOD", help="default: every method")
    p.add_argument("--peers", nargs="*", metavar="PEER", help="torch-budget, per-block (default: both)")
    p.add_argument("--quick", action="store_true", help="two small models, two budgets (a minute or two)")
    p.add_argument("--time-limit", type=_positive_float, default=None, metavar="S", help="per solve (default 60, quick 10)")
    p.add_argument("--backend", choices=("highs", "scip"), default="highs", help="MILP backend")
    p.add_argument("-o", "--output", required=True, metavar="DIR")
    p.set_defaults(func=cmd_bench)

    p = sub.add_parser("export", help="write a runnable checkpointed model that follows a schedule")
    add_model_arguments(p)
    p.add_argument("schedule", metavar="SCHEDULE.json", help="a schedule solved for this model's traced graph")
    p.add_argument("-o", "--output", required=True, metavar="DIR")
    p.set_defaults(func=cmd_export)

    p = sub.add_parser("verify", help="run the original and an exported model side by side and compare")
    add_model_arguments(p)
    p.add_argument("dir", metavar="DIR", help="the folder `bonsai export` wrote")
    p.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    p.add_argument("--grads", choices=("autograd", "direct"), default="autograd", help="how gradients are delivered")
    p.add_argument("--atol", type=_positive_float, default=1e-5, help="loss/gradient tolerance (default 1e-5)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_verify)

    p = sub.add_parser("app", help="start the explorer (streamlit run explorer/app.py)")
    p.add_argument("streamlit_args", nargs=argparse.REMAINDER, help="passed on to streamlit")
    p.set_defaults(func=cmd_app)
    return parser


def _profiles() -> list[str]:
    from bonsai_core.costmodel import PROFILES

    return list(PROFILES)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except BonsaiError as e:
        print(f"bonsai {args.verb}: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"bonsai {args.verb}: interrupted", file=sys.stderr)
        return 130


def entry_point() -> None:
    sys.exit(main())


if __name__ == "__main__":
    entry_point()
