"""The ``bonsai`` command (a contract: scripts and the explorer's export page call it).

Exit status: 0 on success; 1 on a user error (bad file, infeasible budget, unknown model), with a
one-paragraph message on stderr and no traceback; 2 on bad arguments (argparse's convention).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
from pathlib import Path
from typing import Any, Sequence

from bonsai_core.arguments import (CHECKPOINTING, COMPILE_MODES, KERNELS, RESHARD_CHOICES, SCHEDULES, SOLVE_TIME_LIMIT, allocator_policy, budget_arg, overhead_arg, positive, positive_int,
                                   reserved_policy, reshard_arg, solve_time_limit, time_limit_arg)
from bonsai_core.errors import BonsaiError, BudgetError, SolverError
from bonsai_core.optimizer import GRADS, OPTIMIZERS
from bonsai_core.units import format_bytes

# Size options any zoo model may take (each model accepts its own subset; see `bonsai zoo`).
MODEL_OPTIONS = ("batch", "seq", "layers", "width", "heads", "vocab", "image")
# Build options that are names, not sizes (models.build): any model's dtype, an hf: model's attention.
BUILD_OPTIONS = ("dtype", "attention")


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    """MODEL and its size options, shared by trace, export and verify."""
    p.add_argument("model", metavar="MODEL", help="a zoo name, hf:ARCH or hf:PATH/config.json (see `bonsai zoo`), "
                   "torchtitan:llama3:FLAVOUR, or package.module:factory")
    for name in MODEL_OPTIONS:
        p.add_argument(f"--{name}", type=positive_int, default=None, metavar="N", help=f"model option {name}")
    p.add_argument("--seed", type=int, default=0, help="seed for weights and the example batch (default 0)")
    p.add_argument("--autocast", choices=("bf16", "fp16"), default=None,
                   help="trace/run the step under torch.autocast with this dtype (default: off)")
    p.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), default=None,
                   help="the model's parameters (and float inputs) in this dtype: model.to(dtype) (default: as built, fp32)")
    p.add_argument("--attention", choices=("sdpa", "eager"), default=None,
                   help="hf: models: the attention implementation (default: sdpa where the model supports it)")


def add_fsdp_arguments(p: argparse.ArgumentParser) -> None:
    """--fsdp N, --reshard-after-forward and the rest of a parallel layout (--tp, --cp, --pp, ...), shared by
    trace and fit."""
    p.add_argument("--fsdp", type=positive_int, default=1, metavar="N",
                   help="plan one of N ranks of FSDP2 (fully_shard on each block and on the model): sharded parameters, "
                        "gradients and optimizer state, and the unsharded blocks over the step (default 1: no sharding)")
    p.add_argument("--reshard-after-forward", type=reshard_arg, default=None, metavar="|".join(RESHARD_CHOICES),
                   help="with --fsdp: fully_shard's reshard_after_forward for every block; all-but-last: as torchtitan "
                        "applied it in Dec 2024 (its published memory), the last block kept unsharded for its backward; "
                        "torchtitan: as its release 0.2.2's apply_fsdp, with tok_embeddings and [norm, output] units of "
                        "their own; default: true, torchtitan for torchtitan: models")
    p.add_argument("--mixed-precision", choices=("bf16", "fp16", "none"), default=None,
                   help="with --fsdp: FSDP2's MixedPrecisionPolicy(param_dtype=this, reduce_dtype=fp32) on the fp32 "
                        "model: fp32 sharded parameters, gradients and optimizer state, blocks all-gathered and "
                        "computed in this dtype; default: none, bf16 for torchtitan: models (torchtitan's)")
    p.add_argument("--dp-replicate", type=positive_int, default=1, metavar="N",
                   help="HSDP: N replicas of the FSDP group (torchtitan's data_parallel_replicate_degree; default 1)")
    p.add_argument("--tp", type=positive_int, default=1, metavar="N",
                   help="tensor parallel degree: the rank traced with DTensor TP as the model's library applies it "
                        "(torchtitan's parallelize_llama, transformers' tp_plan), on a fake process group (default 1)")
    p.add_argument("--cp", type=positive_int, default=1, metavar="N",
                   help="context parallel degree (torchtitan: models): the sequence sharded, ring attention (default 1)")
    p.add_argument("--pp", type=positive_int, default=1, metavar="N",
                   help="pipeline parallel degree (torchtitan: models): the stage(s) of --rank (default 1)")
    p.add_argument("--pp-schedule", choices=tuple(SCHEDULES), default="1f1b",
                   help="with --pp: torch.distributed.pipelining's Schedule1F1B or ScheduleInterleaved1F1B")
    p.add_argument("--microbatches", type=positive_int, default=None, metavar="M",
                   help="with --pp: microbatches per step (default: one sequence each, torchtitan's default)")
    p.add_argument("--rank", type=int, default=0, metavar="R", help="with --pp: the pipeline rank traced (default 0)")
    p.add_argument("--async-tp", action="store_true",
                   help="torchtitan's AsyncTP: refused, it is an Inductor pass under torch.compile (docs/REAL_RUNS.md)")


def compile_mode(args: argparse.Namespace) -> str | None:
    """--compile's mode; given bare, each block for torchtitan: models (as torchtitan compiles), else the model."""
    if args.compile != "default":
        return args.compile
    return "blocks" if args.model.startswith("torchtitan:") else "model"


def fsdp_options(args: argparse.Namespace) -> dict[str, Any]:
    """The sharding options of trace and fit: FSDP2's, and the parallel layout where it is more than FSDP."""
    from bonsai_core.parallel import layout_of

    layout = layout_of(args.fsdp, args.tp, args.cp, args.pp, args.dp_replicate, args.pp_schedule, args.microbatches,
                       args.rank, args.async_tp)
    return {"fsdp": args.fsdp, "reshard_after_forward": args.reshard_after_forward,
            "mixed_precision": args.mixed_precision, **({"parallel": layout} if layout.is_parallel else {})}


def model_options(args: argparse.Namespace) -> dict[str, Any]:
    """The model's size options and build options (dtype, attention) given on the command line."""
    return {k: getattr(args, k) for k in (*MODEL_OPTIONS, *BUILD_OPTIONS) if getattr(args, k, None) is not None}


def _write_json(path: str, payload: dict[str, Any]) -> None:
    try:
        Path(path).write_text(json.dumps(payload, separators=(",", ":")) + "\n")
    except OSError as e:
        raise BonsaiError(f"Cannot write {path!r}: {e.strerror}. Check that its folder exists and is writable.") from None


# -- verbs ---------------------------------------------------------------------------------------

def cmd_zoo(args: argparse.Namespace) -> int:
    from bonsai_core.models.hf import ARCHS, PREFIX
    from bonsai_core.models.zoo import ZOO

    entries = {**ZOO, **{PREFIX + name: e for name, e in ARCHS.items()}}
    if args.json:
        print(json.dumps({name: {"description": e.description, "options": e.options} for name, e in entries.items()}))
        return 0
    for name, entry in entries.items():
        opts = " ".join(f"--{k} {v}" for k, v in entry.options.items())
        print(f"{name:11s} {entry.description}\n            {opts}")
    print(f"{PREFIX}PATH     a Hugging Face config.json (or its folder): causal LM, masked LM, image classification or seq2seq LM\n"
          "            --batch 8, and --seq (text, default min(128, positions)) or --image (vision, the config's)")
    print("torchtitan:llama3:FLAVOUR torchtitan's own Llama 3 and loss (flavours: debugmodel, 8B, 70B, 405B, ...)\n"
          "            --batch 1 --seq 2048, and --layers, --width, --heads, --vocab (default: the flavour's)")
    print("every model also takes --dtype fp32|bf16|fp16 (its parameters' type); hf: models --attention sdpa|eager "
          "(default: sdpa where the model supports it)")
    return 0


def cmd_trace(args: argparse.Namespace) -> int:
    from bonsai_core.graph import save_graph
    from bonsai_core.optimizer import with_training_loop
    from bonsai_core.schedule import no_remat_peak
    from bonsai_core.rank import trace as trace_model

    traced = trace_model(args.model, profile=args.cost_model, seed=args.seed, autocast=args.autocast,
                         compile=compile_mode(args), ac=args.ac, float8=args.float8, kernels=args.kernels,
                         **fsdp_options(args), **model_options(args))
    g = with_training_loop(traced.graph, args.model, args.optimizer, args.grads)
    try:
        save_graph(g, args.output)
    except OSError as e:
        raise BonsaiError(f"Cannot write {args.output!r}: {e.strerror}.") from None
    summary = {**g.summary(), "no_remat_peak": no_remat_peak(g), "trace_seconds": traced.seconds,
               "cost_model": args.cost_model}
    if args.json:
        print(json.dumps(summary))
    else:
        inplace = f", {summary['inplace_writes']} run in place" if summary["inplace_writes"] else ""
        print(f"traced {g.name}: {g.n} nodes ({summary['forward_nodes']} forward{inplace}), {g.num_edges} edges in "
              f"{traced.seconds:.2f} s; no-remat peak {format_bytes(summary['no_remat_peak'])}, fixed "
              f"{format_bytes(g.fixed_mem)}; wrote {args.output}")
    return 0


def cmd_solve(args: argparse.Namespace) -> int:
    from bonsai_core.graph import load_graph
    from bonsai_core.schedule import no_remat_peak
    from bonsai_core.solvers import check_options, parse_option, solve, solve_reserved

    policy = reserved_policy(args)
    options = dict(parse_option(args.method, text) for text in args.option)
    flags = {k: v for k, v in (("granularity", args.granularity), ("backend", args.backend),
                               ("time_limit", args.time_limit)) if v is not None}
    for name in sorted(set(flags) & set(options)):
        if flags[name] != options[name]:
            raise BonsaiError(f"--{name.replace('_', '-')} {flags[name]} and --option {name}={options[name]} disagree; "
                              "give it once.")
    options.update(flags)
    options["time_limit"] = solve_time_limit(options.get("time_limit", SOLVE_TIME_LIMIT))
    check_options(args.method, options)  # before a long trace is loaded
    g = load_graph(args.graph)
    reference = no_remat_peak(g)
    budget = args.budget.resolve(reference)
    try:
        if policy:
            schedule = solve_reserved(g, budget, args.method, policy=policy, **options)
        else:
            schedule = solve(g, budget, method=args.method, **options)
    except BudgetError as e:
        if policy:  # another method's live-byte schedule says nothing of its reserved bytes
            raise
        raise _naming_a_method_that_meets(g, budget, args.method, e, options["time_limit"]) from None
    _write_json(args.output, schedule.to_dict())
    stats = {"method": args.method, "budget": budget, "no_remat_peak": reference, **schedule.stats}
    if args.json:
        print(json.dumps(stats))
    else:
        print(f"{args.method} on {g.name} under {format_bytes(budget)} ({budget / reference:.0%} of the no-remat "
              f"peak): peak {format_bytes(stats['peak'])}"
              + (f", reserved {format_bytes(stats['reserved_peak'])} ({stats['allocator']} allocator)"
                 if args.reserved else "")
              + f", overhead {stats['overhead']:+.2%}, status "
              f"{stats.get('status', '?')}"
              + (f" (gap {stats['gap']:.2%})" if stats.get("status") == "feasible" and stats.get("gap") is not None else "")
              + f", solved in {stats.get('wall_seconds', stats.get('solve_seconds', 0)):.2f} s wall"
              + _time_split(stats) + f"; wrote {args.output}")
        if "warm_start" in stats:
            print(f"warm start: {stats['warm_start']}")
        if stats.get("bound") is not None:
            print(f"lower bound: no schedule within the budget computes less than {stats['bound']:.6g} s "
                  f"({stats['bound'] / g.total_cost - 1:+.2%}); this plan is {stats['bound_gap']:.2%} above it"
                  + (f" ({stats['space']} plan; searched: {', '.join(stats['spaces'])})" if "spaces" in stats else ""))
    return 0


def _time_split(stats: dict) -> str:
    """" (build 1.2 s, solve 3.4 s, ...)": where a solve's wall time went, when the method says."""
    parts = stats.get("time_split")
    if not parts:
        return ""
    return " (" + ", ".join(f"{k} {v:.2f} s" for k, v in parts.items()) + ")"


def _naming_a_method_that_meets(graph: Any, budget: int, method: str, error: BudgetError,
                                time_limit: float | None) -> BudgetError:
    """``error`` with the method that meets ``budget`` named, with its peak and overhead, when one does
    (each method tried for at most 15 s, or the user's time limit if shorter)."""
    from bonsai_core.solvers import method_meeting

    other = method_meeting(graph, budget, method, time_limit=min(15.0, time_limit or 15.0))
    if other is None:
        return error
    st = other.stats
    return BudgetError(f"{error} {other.method} meets this budget (peak {format_bytes(st['peak'])}, overhead "
                       f"{st['overhead']:+.2%}): --method {other.method}.")


def cmd_methods(args: argparse.Namespace) -> int:
    from bonsai_core.solvers import METHODS, describe, method_options, type_name

    listing = {}
    for m in ([args.method] if args.method else METHODS):
        options = method_options(m)
        listing[m] = {"description": describe(m), "options": None if options is None else [
            {"name": o.name, "default": o.default, "type": type_name(o.type), "help": o.help} for o in options]}
    if args.json:
        print(json.dumps(listing, default=str))
        return 0
    for m, entry in listing.items():
        print(f"{m:10s} {entry['description']}")
        if entry["options"] is None:
            print("           options: none declared (its solver takes **kwargs: any --option is passed on unchecked)")
        for o in entry["options"] or ():
            print(f"           --option {o['name']}=...  {o['type']}, default {o['default']!r}"
                  + (f": {o['help']}" if o["help"] else ""))
    return 0


def cmd_simulate(args: argparse.Namespace) -> int:
    from bonsai_core.graph import load_graph
    from bonsai_core.schedule import load_schedule, simulate

    if (args.expandable_segments or args.arena) and not args.allocator:
        flag = "--arena" if args.arena else "--expandable-segments"
        raise BonsaiError(f"{flag} chooses the allocator model that --allocator replays; give --allocator too.")
    if args.expandable_segments and args.arena:
        raise BonsaiError("--arena and --expandable-segments are two allocator models: choose one.")
    g = load_graph(args.graph)
    schedule = load_schedule(args.schedule)
    sim = simulate(g, schedule)
    stats = {"graph": g.name, "method": schedule.method, "budget": schedule.budget, **sim.stats(),
             "feasible": sim.feasible(schedule.budget), "ops": len(schedule.ops)}
    if args.allocator:
        from bonsai_core.allocator import replay_as_solved
        from bonsai_core.solvers.pool import pool_replay

        # a plan solved for reserved bytes is replayed as its budget bounded it (the allocator it was solved within)
        policy = allocator_policy(args) if args.expandable_segments else None
        alloc = (pool_replay(g, schedule) if args.arena else replay_as_solved(g, schedule, policy)).stats()
        # the allocator's live bytes include the optimizer state: its own name, not the simulator's peak
        alloc["allocator_live_peak"] = alloc.pop("peak")
        stats.update(alloc)
    if args.json:
        print(json.dumps(stats))
    else:
        fits = "" if schedule.budget is None else (" (within budget)" if stats["feasible"] else " (OVER budget)")
        print(f"{schedule.method} schedule on {g.name}: {len(schedule.ops)} ops, peak {format_bytes(sim.peak)}{fits}, "
              f"compute {sim.compute_cost:.6g} s, overhead {sim.overhead:+.2%}, {sim.recomputes} recomputations")
        if args.allocator:
            print(f"{stats['allocator']} allocator: reserved peak {format_bytes(stats['reserved_peak'])} in {stats['segments']} "
                  f"segment(s), fragmentation {stats['fragmentation']:.1%} at the reserved peak")
    if not stats["feasible"]:
        raise BonsaiError(f"the schedule's peak {format_bytes(sim.peak)} exceeds its budget "
                          f"{format_bytes(schedule.budget)} by {format_bytes(sim.peak - schedule.budget)}.")
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    """``bonsai bench [SUITE] [options]``: the suite named (default ``methods``), or ``--list`` the suites."""
    from bonsai_core import bench

    if args.list:
        print(bench.suite_list())
        return 0
    if args.suite is None:
        return bench.suite(bench.DEFAULT_SUITE).main(args)
    return args.suite_main(args)


def _check_fit_arguments(args: argparse.Namespace, methods: Sequence[str]) -> None:
    """Refuse --methods that fit does not know and a --gpu given as a share, before anything is traced."""
    from bonsai_core import fit

    for m in methods:
        try:
            fit.method_variant(m)
        except SolverError as e:
            args.parser.error(f"argument --methods: {e}")
    if args.gpu.fraction is not None:
        args.parser.error("argument --gpu: give the GPU's memory in bytes or with a unit (80GiB), not a share")


def cmd_fit(args: argparse.Namespace) -> int:
    from bonsai_core import fit

    if args.gpus:
        return _fit_layouts(args)
    methods = args.methods or ["none", "bonsai", "chen", "dtr"]
    _check_fit_arguments(args, methods)
    reserved = reserved_policy(args)
    limit = args.gpu.resolve(0)
    time_limit = solve_time_limit(args.time_limit)
    max_overhead = 0.10 if args.max_overhead is None else args.max_overhead
    result = fit.fit(args.model, limit, methods, vary=args.vary, max_overhead=max_overhead,
                     options=model_options(args), optimizer=args.optimizer, reserved=reserved,
                     solver_options={"time_limit": time_limit}, start=args.start,
                     progress=(lambda line: print(line, flush=True)) if not args.json else None,
                     trace_kwargs={"seed": args.seed, "autocast": args.autocast, **fsdp_options(args)})
    rows = fit.table(result)
    written = fit.write_report(result, args.output) if args.output else []
    if args.json:
        print(json.dumps({"rows": rows, "attempts": [a.row() for a in result.attempts],
                          "trace_seconds": result.traces}))
        return 0
    print(fit.markdown_table(result))
    print(f"traced {len(result.traces)} sizes in {sum(result.traces.values()):.1f} s, "
          f"{len(result.attempts)} solves in {sum(a.seconds for a in result.attempts):.1f} s"
          + (f"; wrote {', '.join(written)} to {args.output}" if written else ""))
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from bonsai_core.schedule import load_schedule

    schedule = load_schedule(args.schedule)
    if args.backend == "checkpoint":
        from bonsai_core.export.checkpoint import export_checkpoint

        out = export_checkpoint(args.model, model_options(args), schedule, args.output, seed=args.seed,
                                autocast=args.autocast)
    else:
        from bonsai_core.export import export_model

        out = export_model(args.model, model_options(args), schedule, args.output, seed=args.seed,
                           autocast=args.autocast)
    opts = "".join(f" --{k} {v}" for k, v in model_options(args).items())
    opts += f" --autocast {args.autocast}" if args.autocast else ""
    print(f"exported {args.model} with its {schedule.method} schedule ({args.backend} back-end) to {out} "
          f"(checkpointed.py, schedule.json, README.md); check it with: bonsai verify {args.model}{opts} {out}")
    if args.backend == "checkpoint":
        from bonsai_core.export.verify import load_checkpointed

        info = load_checkpointed(out).INFO
        for path, why in info.get("not_checkpointed", {}).items():
            print(f"note: {path} is not checkpointed: {why}.")
        if info["realised_peak"] > 1.05 * info["predicted_peak"] and schedule.stats.get("regions") != "modules":
            print(f"note: the submodule checkpoints can only approximate this plan: simulated peak "
                  f"{format_bytes(info['realised_peak'])} against the plan's {format_bytes(info['predicted_peak'])}. "
                  "A plan that recomputes module calls only is followed exactly: solve with --option regions=modules.")
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    from bonsai_core.export.folder import export_backend

    if export_backend(args.dir) == "checkpoint":
        from bonsai_core.export.verify import verify_checkpoint

        v = verify_checkpoint(args.model, model_options(args), args.dir, device=args.device, seed=args.seed,
                              autocast=args.autocast)
    else:
        from bonsai_core.export import verify_export

        v = verify_export(args.model, model_options(args), args.dir, device=args.device, seed=args.seed,
                          grads=args.grads, autocast=args.autocast)
    report = v.to_dict()
    problems = v.problems(atol=args.atol, peak_tolerance=args.peak_tolerance)
    ok = not problems
    if args.json:
        print(json.dumps({**report, "ok": ok, "problems": problems}))
        return 0 if ok else 1
    print(f"on {report.get('device', args.device)}: loss {report['loss_exported']:.6g} (original {report['loss_original']:.6g}, "
          f"difference {report['loss_diff']:.3g}); {_gradient_difference(report)}")
    if report.get("predicted_peak") is None:  # the checkpoint back-end away from the traced run
        why = report.get("unpredicted") or "no prediction for this size"
        print(f"peak: measured {format_bytes(report['measured_peak'])} (not judged: {why}); original "
              f"model {format_bytes(report['original_peak'])}")
    else:
        print(f"peak: predicted {format_bytes(report['predicted_peak'])}, measured {format_bytes(report['measured_peak'])} "
              f"({report['peak_error']:+.2%}, tolerance ±{args.peak_tolerance:.0%}); original model "
              f"{format_bytes(report['original_peak'])}")
    if report.get("judged_on_realised"):
        print(f"the checkpoints hold the plan's regions in part (the export's README says which): what they run "
              f"peaks at {format_bytes(report['realised_peak'])} simulated, measured {report['realised_peak_error']:+.2%}")
    if "measured_peak_grads_none" in report:
        print(f"with .grad None (after zero_grad): measured {format_bytes(report['measured_peak_grads_none'])} "
              f"({report['peak_error_grads_none']:+.2%}), gradient difference {report['max_grad_diff_grads_none']:.3g}; "
              f"buffers after the step differ by {report['max_buffer_diff']:.3g}")
    if report.get("seconds_original"):
        measured = report["seconds_exported"] / report["seconds_original"] - 1.0
        print(f"time per step: original {report['seconds_original'] * 1e3:.1f} ms, exported "
              f"{report['seconds_exported'] * 1e3:.1f} ms (overhead {measured:+.1%} measured, "
              f"{report.get('predicted_overhead') or 0.0:+.1%} predicted compute)")
    print("OK" if ok else "MISMATCH: " + "; ".join(problems))
    return 0 if ok else 1


def _gradient_difference(report: dict[str, Any]) -> str:
    """The largest gradient difference, absolute and relative to its tensor's largest magnitude."""
    absolute = max(report["max_grad_diff"], report.get("max_grad_diff_grads_none", 0.0))
    if absolute == 0:
        return "gradients bitwise equal"
    return (f"largest gradient difference {absolute:.3g} absolute, "
            f"{report.get('max_grad_scaled_diff', 0.0):.3g} of its tensor's largest magnitude")


def explorer_root() -> Path:
    """The folder holding ``explorer/app.py``, ``pages/``, ``assets/`` and the Streamlit config: the
    checkout this module runs from, else the installed ``bonsai_explorer`` package."""
    import importlib.util

    checkout = Path(__file__).resolve().parent.parent
    if (checkout / "explorer" / "app.py").is_file():
        return checkout
    spec = importlib.util.find_spec("bonsai_explorer.explorer")
    if spec is None or spec.origin is None:
        raise BonsaiError("The explorer is not installed (no explorer/app.py next to bonsai_core, no bonsai_explorer "
                          "package): reinstall with `pip install .` from a checkout of the project.")
    return Path(spec.origin).resolve().parent.parent


def streamlit_flags(config: Path) -> list[str]:
    """The options of a Streamlit config.toml as ``streamlit run`` flags (``--client.toolbarMode=minimal``):
    Streamlit reads config.toml only from the working directory, and ``bonsai app`` runs from anywhere."""
    import tomllib

    if not config.is_file():
        return []
    flags: list[str] = []

    def walk(prefix: str, table: dict[str, Any]) -> None:
        for key, value in table.items():
            name = f"{prefix}.{key}" if prefix else key
            if isinstance(value, dict):
                walk(name, value)
            else:
                for item in value if isinstance(value, list) else [value]:
                    text = str(item).lower() if isinstance(item, bool) else str(item)
                    flags.append(f"--{name}={text}")

    walk("", tomllib.loads(config.read_text()))
    return flags


def cmd_app(args: argparse.Namespace) -> int:
    root = explorer_root()
    config = next((c for c in (root / ".streamlit" / "config.toml", root / "streamlit" / "config.toml") if c.is_file()),
                  root / ".streamlit" / "config.toml")
    command = [sys.executable, "-m", "streamlit", "run", *streamlit_flags(config), str(root / "explorer" / "app.py"),
               *args.streamlit_args]
    if args.print_command:
        print(" ".join(command))
        return 0
    os.execvp(sys.executable, command)
    return 0  # not reached


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="bonsai", description="Optimal tensor rematerialization explorer.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = parser.add_subparsers(dest="verb", required=True, metavar="VERB")
    for add in (_add_model_parsers, _add_solve_parsers, _add_bench_parser, _add_fit_parser, _add_export_parsers,
                _add_app_parser):
        add(sub)
    return parser


def _add_model_parsers(sub: Any) -> None:
    """``zoo`` and ``trace``: the models there are, and a model's training step into a graph."""
    p = sub.add_parser("zoo", help="list built-in models and their options")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_zoo)

    p = sub.add_parser("trace", help="trace a model's training step into a bonsai-graph JSON")
    add_model_arguments(p)
    p.add_argument("--cost-model", default="h100", choices=_profiles(), help="device profile for op costs")
    p.add_argument("--optimizer", default="none", choices=OPTIMIZERS,
                   help="the optimizer step after the backward pass (foreach, as on CUDA): its state is fixed memory "
                        "and its step's temporaries can set the peak (default none)")
    p.add_argument("--grads", default=None, choices=GRADS,
                   help="the gradients between steps: zeroed (zero_grad(set_to_none=False): their buffers are fixed "
                        "memory) or none (optimizer.zero_grad()'s default: each step makes them in its backward pass "
                        "and holds them to the optimizer step); default: the model's own training loop's, none for a "
                        "torchtitan: model's eager step (its trainer calls optimizers.zero_grad()), zeroed for any "
                        "other and under --compile")
    add_fsdp_arguments(p)
    p.add_argument("--compile", nargs="?", const="default", default=None, choices=(*COMPILE_MODES, "default"),
                   metavar="|".join(COMPILE_MODES),
                   help="the step as torch.compile (inductor) runs it: the partitioner's saved tensors, inductor's fused "
                        "kernels and buffers; model: torch.compile(model), blocks: each block with fullgraph=True "
                        "(torchtitan's apply_compile); bare: blocks for torchtitan: models, else model")
    p.add_argument("--ac", default=None, metavar="|".join(CHECKPOINTING),
                   help="with --compile: activation checkpointing applied before compiling: torchtitan's own apply_ac "
                        "(torchtitan: models; selective is op-level, with 0.2.2's save list or December 2024's), or "
                        "budget:F, torch's activation_memory_budget for the partitioner (0..1)")
    p.add_argument("--float8", action="store_true",
                   help="with --compile, torchtitan: models: torchtitan's Float8 linears (torchao's tensorwise float8 "
                        "training, no float8 all-gather), applied before checkpointing and compiling")
    p.add_argument("--kernels", default="cuda", choices=KERNELS,
                   help="the device whose kernels the step runs: its dropout and attention-with-dropout kernels and, "
                        "with --compile, the partitioner's choices (which attention kernel it never recomputes); "
                        "default cuda, whatever device traces")
    p.add_argument("-o", "--output", required=True, metavar="GRAPH.json")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.set_defaults(func=cmd_trace)


def _add_solve_parsers(sub: Any) -> None:
    """``solve``, ``methods`` and ``simulate``: a schedule under a budget, the methods, and the replay."""
    from bonsai_core.solvers import DEFAULT_METHOD, METHODS

    p = sub.add_parser("solve", help="find a rematerialization schedule under a memory budget")
    p.add_argument("graph", metavar="GRAPH.json")
    p.add_argument("--budget", required=True, type=budget_arg,
                   help="bytes (123456789), with a unit (800MiB, 2.5GB) or a share of the no-remat peak (60%%)")
    p.add_argument("--method", default=DEFAULT_METHOD, choices=list(METHODS),
                   help=f"default {DEFAULT_METHOD}; `bonsai methods` describes each and its options")
    p.add_argument("--option", action="append", default=[], metavar="NAME=VALUE",
                   help="a method option, e.g. copies=3 (moccasin), variant=greedy (chen); repeat for more")
    p.add_argument("--granularity", type=positive_int, default=None, help="largest segment size (bonsai)")
    p.add_argument("--backend", choices=("highs", "scip"), default=None, help="MILP backend")
    p.add_argument("--time-limit", type=time_limit_arg, default=None, metavar="S",
                   help=f"seconds for the whole solve (default {SOLVE_TIME_LIMIT:g}; 0: no limit); past it the "
                        "best schedule found is returned, its status saying so")
    p.add_argument("--reserved", action="store_true",
                   help="the budget bounds the bytes the caching-allocator model reserves (what the GPU holds), "
                        "not live tensor bytes")
    p.add_argument("--expandable-segments", action="store_true",
                   help="with --reserved: model PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True")
    p.add_argument("-o", "--output", required=True, metavar="SCHEDULE.json")
    p.add_argument("--json", action="store_true", help="print the stats as one JSON object")
    p.set_defaults(func=cmd_solve)

    p = sub.add_parser("methods", help="list the methods and the options each takes")
    p.add_argument("method", nargs="?", choices=list(METHODS), help="only this method")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_methods)

    p = sub.add_parser("simulate", help="replay a schedule and report its peak memory and cost")
    p.add_argument("graph", metavar="GRAPH.json")
    p.add_argument("schedule", metavar="SCHEDULE.json")
    p.add_argument("--allocator", action="store_true",
                   help="also replay through the caching-allocator model: reserved peak and fragmentation")
    p.add_argument("--expandable-segments", action="store_true",
                   help="with --allocator: model PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True")
    p.add_argument("--arena", action="store_true",
                   help="with --allocator: replay in one pre-reserved pool of the schedule's budget (Coop's and "
                        "OneFlow's arena), placed as its method placed it (coop, dtr with allocator=true)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_simulate)


def _add_bench_parser(sub: Any) -> None:
    """``bench``: the benchmark suites; with no suite, the default suite's options on ``bench`` itself."""
    from bonsai_core import bench

    p = sub.add_parser("bench", help="benchmark suites (default: every method and peer on the same models and "
                                     "budgets: tables and plots); --list names them")
    bench.suite(bench.DEFAULT_SUITE).add_arguments(p, output_required=False)
    p.add_argument("--list", action="store_true", help="list the suites and what each measures")
    bench.add_suite_parsers(p)
    p.set_defaults(func=cmd_bench, parser=p)


def _fit_layouts(args: argparse.Namespace) -> int:
    """``bonsai fit MODEL --gpus N``: every layout of N GPUs and local batch (:func:`bonsai_core.fit.fit_layouts`)."""
    import time

    from bonsai_core import fit
    from bonsai_core.models import torchtitan as titan

    methods = args.methods or fit.LAYOUT_METHODS
    _check_fit_arguments(args, methods)
    start = time.perf_counter()
    options = model_options(args)
    seq = options.pop("seq", None) or titan.DEFAULTS["seq"]
    result = fit.fit_layouts(args.model, args.gpus, args.gpu.resolve(0), methods, seq=seq, options=options,
                             optimizer=args.optimizer, reserved=reserved_policy(args),
                             max_overhead=float("inf") if args.max_overhead is None else args.max_overhead,
                             solver_options={"time_limit": solve_time_limit(args.time_limit)},
                             progress=(lambda line: print(line, flush=True)) if not args.json else None,
                             trace_kwargs={"seed": args.seed, "autocast": args.autocast,
                                           "reshard_after_forward": args.reshard_after_forward,
                                           "mixed_precision": args.mixed_precision})
    table = fit.layouts_markdown(result)
    if args.output:
        out = Path(args.output)
        out.mkdir(parents=True, exist_ok=True)
        (out / "fit-layouts.md").write_text(table + "\n")
        (out / "fit-layouts.json").write_text(json.dumps([f.row() for f in result.fits], indent=1) + "\n")
    if args.json:
        print(json.dumps({"fits": [f.row() for f in result.fits], "trace_seconds": result.trace_seconds,
                          "traces": result.traces, "seconds": time.perf_counter() - start}))
        return 0
    print(table)
    print(f"{result.traces} rank structures traced in {result.trace_seconds:.1f} s; {len(result.fits)} layout and batch "
          f"attempts in {time.perf_counter() - start:.1f} s")
    return 0


def _add_fit_parser(sub: Any) -> None:
    """``fit``: the largest size each method trains within a GPU's memory."""
    p = sub.add_parser("fit", help="the largest micro-batch (or sequence) each method trains within a GPU's memory")
    add_model_arguments(p)
    p.add_argument("--gpu", required=True, type=budget_arg, metavar="BYTES", help="the GPU's memory, e.g. 80GiB")
    p.add_argument("--gpus", type=positive_int, default=None, metavar="N",
                   help="torchtitan: models: search the layouts of N GPUs (TP, PP with both schedules, CP, FSDP, HSDP) "
                        "and each one's local batch: the least recompute that fits and the tokens per GPU per step "
                        "(methods default: none torchtitan-selective torchtitan-full)")
    p.add_argument("--vary", choices=("batch", "seq"), default="batch", help="the size searched (default batch)")
    p.add_argument("--start", type=positive_int, default=1, metavar="N", help="the first size tried (default 1)")
    p.add_argument("--max-overhead", type=overhead_arg, default=None, metavar="PCT",
                   help="the largest recompute overhead accepted (default 10%%; with --gpus none)")
    p.add_argument("--methods", nargs="+", metavar="METHOD",
                   help="default: none bonsai chen dtr; a variant as METHOD:NAME=VALUE,... (bonsai:offload=true)")
    p.add_argument("--optimizer", default="none", choices=OPTIMIZERS, help="the optimizer step (see trace)")
    add_fsdp_arguments(p)
    p.add_argument("--reserved", action="store_true", help="the GPU's memory bounds the caching allocator's reserved bytes")
    p.add_argument("--expandable-segments", action="store_true", help="with --reserved: expandable segments")
    p.add_argument("--time-limit", type=time_limit_arg, default=SOLVE_TIME_LIMIT, metavar="S",
                   help=f"seconds per solve (default {SOLVE_TIME_LIMIT:g}; 0: none)")
    p.add_argument("-o", "--output", default=None, metavar="DIR", help="write fit.csv, fit.md, fit.png and the plans")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_fit, parser=p)


def _add_export_parsers(sub: Any) -> None:
    """``export`` and ``verify``: a runnable model that follows a schedule, checked against the original."""
    p = sub.add_parser("export", help="write a runnable checkpointed model that follows a schedule")
    add_model_arguments(p)
    p.add_argument("schedule", metavar="SCHEDULE.json", help="a schedule solved for this model's traced graph")
    p.add_argument("-o", "--output", required=True, metavar="DIR")
    p.add_argument("--backend", choices=("replay", "checkpoint"), default="replay",
                   help="replay: the traced step as generated Python (any schedule; default); checkpoint: "
                        "torch.utils.checkpoint on your own module (region schedules)")
    p.set_defaults(func=cmd_export)

    p = sub.add_parser("verify", help="run the original and an exported model side by side and compare")
    add_model_arguments(p)
    p.add_argument("dir", metavar="DIR", help="the folder `bonsai export` wrote")
    p.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    p.add_argument("--grads", choices=("autograd", "direct"), default="autograd", help="how gradients are delivered")
    p.add_argument("--atol", type=positive(" (an absolute tolerance, e.g. 1e-5)"), default=1e-5, help="loss/gradient tolerance (default 1e-5)")
    p.add_argument("--peak-tolerance", type=positive(" (a share of the predicted peak, e.g. 0.1 for 10%)"), default=0.10, metavar="SHARE",
                   help="largest |measured/predicted - 1| of the peak, above or below (default 0.10)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_verify)


def _add_app_parser(sub: Any) -> None:
    """``app``: the explorer."""
    p = sub.add_parser("app", help="start the explorer (streamlit run explorer/app.py)",
                       epilog="Any other argument is passed on to streamlit, e.g. bonsai app --server.port 8502.")
    p.add_argument("--print-command", action="store_true", help="print the streamlit command instead of running it")
    p.set_defaults(func=cmd_app, streamlit_args=[])  # every other argument goes to streamlit, e.g. --server.port 8502


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("bonsai-explorer")
    except PackageNotFoundError:  # run from a checkout that was never installed
        from bonsai_core.version import __version__

        return __version__


def _profiles() -> list[str]:
    from bonsai_core.costmodel import PROFILES

    return list(PROFILES)


def _negative_values_attached(argv: Sequence[str]) -> list[str]:
    """``--budget -5%`` as ``--budget=-5%``: argparse takes a value that starts with "-" and is not a
    plain number for an option, and would say "expected one argument" instead of what is wrong."""
    out: list[str] = []
    for arg in argv:
        if out and out[-1] in ("--budget", "--time-limit") and arg.startswith("-") and arg[1:2].isdigit():
            out[-1] += "=" + arg
        else:
            out.append(arg)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(_negative_values_attached(sys.argv[1:] if argv is None else argv))
    if extra and args.verb != "app":  # `bonsai app` passes options it does not know on to streamlit
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if extra:
        args.streamlit_args = extra
    try:
        return args.func(args)
    except BonsaiError as e:
        print(f"bonsai {args.verb}: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"bonsai {args.verb}: interrupted", file=sys.stderr)
        return 130


def entry_point() -> None:
    code = main()
    # the objects left by a pipeline rank's trace (torch.distributed's on the torn-down fake process group)
    # can corrupt the heap when the interpreter's last collection frees them: the process ends without it
    gc.freeze()
    sys.exit(code)


if __name__ == "__main__":
    entry_point()
