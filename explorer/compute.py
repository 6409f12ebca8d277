"""Every heavy call the app makes, cached once for all sessions and keyed by graph hash + options.

Graphs are hashed by their content hash (``Graph.hash``), so two sessions tracing the same model
share every solve. Results are immutable records; pages only read them. Errors a user can cause
(``BonsaiError``) are cached as part of the outcome too, so dragging the budget slider back over an
infeasible value is as fast as over a feasible one.
"""

from __future__ import annotations

import contextlib
import inspect
import math
import time
import typing
from dataclasses import dataclass, field, replace
from functools import cached_property
from pathlib import Path
from typing import Any, Literal

import numpy as np
import streamlit as st

from bonsai_core import solvers
from bonsai_core.errors import BonsaiError
from bonsai_core.graph import Graph
from bonsai_core.regions import CheckpointPlan, RegionBound, region_peak_bound
from bonsai_core.schedule import Schedule, SimResult, none_schedule, simulate, simulated
from bonsai_core.solvers.deadline import cpu_seconds
from explorer import background, disk

GRAPH_HASH = {Graph: lambda g: g.hash}

Options = tuple[tuple[str, Any], ...]

# Sessions rerun in threads and solve concurrently. No app-wide lock: a method that reuses a built
# problem across calls guards it itself (bonsai's cached segment ILPs and checkmate's cached MILPs are
# CVXPY problems whose budget Parameter is set before each solve, each behind its module's lock), the
# other methods keep no state between calls, and ``st.cache_resource`` computes each key once, so
# sessions asking for the same solve wait for that one computation.


@dataclass(frozen=True)
class Model:
    """The model the session works on: its graph and where it came from."""

    graph: Graph
    source: str  # "zoo" (also hf:ARCH), "hf-config", "json" or "pt2"
    label: str  # what the user sees ("gpt (default)", "my_graph.json", ...)
    zoo: str | None = None  # zoo name or hf:ARCH, when the exporter can rebuild the model
    options: dict[str, int] = field(default_factory=dict)
    parameters: int | None = None  # parameter count, when known
    note: str = ""  # e.g. the loss used for a .pt2 upload
    link: str | None = None  # what a link names the model by, when not ``zoo`` (an uploaded config: hf-config:KEY)
    compiled: str | None = None  # the torch.compile mode whose curve the Memory page draws beside the plan's

    @property
    def link_name(self) -> str | None:
        """The model's name in a link (``?model=``): a zoo, ``hf:`` or torchtitan name, ``hf-config:KEY`` for
        an uploaded Hugging Face config; None for an upload that cannot be rebuilt (graph JSON, .pt2)."""
        return self.link if self.link is not None else self.zoo

    @property
    def spec_in_commands(self) -> str | None:
        """The model as the user's own ``bonsai`` commands name it: an uploaded config by its file name
        (``hf:llama.json``), anything else as ``zoo``."""
        if self.link is not None and self.link.startswith(CONFIG_LINK) and self.zoo:
            return hf_prefix() + Path(self.zoo.removeprefix(hf_prefix())).name
        return self.zoo


ALLOCATORS = {"caching": "PyTorch's caching allocator", "expandable": "expandable segments"}


@dataclass(frozen=True)
class Bound:
    """What a plan's budget bounds: the live tensor bytes (every method's own bound), or the bytes the
    allocator model reserves (``bonsai solve --reserved``: ``solvers.solve_reserved``)."""

    budget: int | None
    reserved: str | None = None  # the allocator policy whose reserved bytes ``budget`` bounds (ALLOCATORS)
    live_budget: int | None = None  # the live budget the method met under a reserved bound
    reserved_peak: int | None = None  # the reserved peak of the plan, under a reserved bound

    @property
    def label(self) -> str:
        """The budget line's name on a memory chart."""
        return "reserved-bytes bound" if self.reserved else "budget"


@dataclass(frozen=True)
class Outcome:
    """One solve: a validated schedule with its simulation, or the error message to show."""

    method: str
    budget: int | None
    options: Options
    schedule: Schedule | None = None
    sim: SimResult | None = None
    error: str | None = None
    wall_seconds: float = 0.0
    cpu_seconds: float = 0.0  # the solving thread's: what its time limit counts (0 when read from the disk)
    reserved: str | None = None  # solved for the reserved bytes of this allocator policy (ALLOCATORS)
    kept: bool = False  # read from the disk (explorer.disk): solved before, by this code
    stand_in_for: float | None = None  # shown for this budget (% of the no-remat peak) while it is solved

    @property
    def ok(self) -> bool:
        return self.schedule is not None

    @cached_property
    def plan(self) -> CheckpointPlan | None:
        """The checkpoint regions of a segment method's schedule (bonsai, chen, ...); None for a
        schedule of single ops (dtr, checkmate, ...) or a failed solve."""
        if self.schedule is None or "segments" not in self.schedule.extra:
            return None
        return CheckpointPlan.from_extra(self.schedule.extra)

    @property
    def bound(self) -> Bound:
        """What the budget bounds, and under a reserved bound what the method met."""
        stats = self.schedule.stats if self.schedule is not None else {}
        return Bound(self.budget, self.reserved, stats.get("live_budget"), stats.get("reserved_peak"))


# -- models ----------------------------------------------------------------------------------------

@st.cache_resource(show_spinner=False)
def default_model(path: str) -> Model:
    from bonsai_core.graph import load_graph

    graph = load_graph(path)
    # the asset is `bonsai trace gpt` at its default options (a test pins this); parameters are
    # counted later, so that the first paint does not wait for torch
    return Model(graph, "zoo", "gpt (built-in default)", zoo="gpt", options={})


# Options of how the step runs rather than of the model's size: trace_model takes them, the model does not
RUN_OPTIONS = ("fsdp", "tp", "cp", "pp", "pp_schedule", "rank")


@st.cache_resource(show_spinner=False, max_entries=32)
def zoo_parameters(name: str, options: Options) -> int:
    """Parameter count of a zoo model, built under FakeTensorMode (no weights allocated)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from bonsai_core import models

    with FakeTensorMode(allow_non_fake_inputs=True):
        model, _, _ = models.build(name, **{k: v for k, v in options if k not in RUN_OPTIONS})
        return int(sum(p.numel() for p in model.parameters()))


@st.cache_resource(show_spinner=False, max_entries=32)
def trace_model(name: str, options: Options) -> Model:
    """Trace a zoo model's training step (raises ModelError on bad options); with ``fsdp`` among the
    options, as one of that many FSDP ranks holds it, sharded as the model's own setting shards it; with
    ``tp``, ``cp``, ``pp`` (``pp_schedule``, ``rank``), one rank of that layout (:mod:`bonsai_core.parallel`);
    no optimizer, its gradients left between steps as the model's own loop leaves them (a torchtitan step sets
    them to None: :func:`bonsai_core.optimizer.with_training_loop`)."""
    from bonsai_core.optimizer import with_training_loop

    graph = with_training_loop(traced_step(name, options), name, "none")
    label = graph.name
    return Model(graph, "zoo", label, zoo=name, options=dict(options),
                 parameters=zoo_parameters(name, options))


@st.cache_resource(show_spinner=False, max_entries=8)
def traced_step(name: str, options: Options) -> Graph:
    """A zoo model's step as traced, before its training loop (:func:`trace_model`'s graph is this one in it):
    what What fits adds an optimizer to, kept so that it does not trace the session's model again; kept on
    disk too (:func:`explorer.disk.save_trace`), so that a new server does not trace it again either."""
    from bonsai_core.parallel import layout_of
    from bonsai_core.rank import trace

    kept = disk.load_trace(name, options)
    if kept is not None:
        return kept
    kwargs = dict(options)
    degrees = {k: kwargs.pop(k) for k in ("tp", "cp", "pp", "pp_schedule", "rank") if k in kwargs}
    if degrees:  # one rank of a parallel layout (the torchtitan tab)
        kwargs["parallel"] = layout_of(fsdp=kwargs.pop("fsdp", 1), **degrees)
    graph = trace(name, **kwargs).graph
    disk.save_trace(name, options, graph)
    return graph


TITAN_FAMILY = "torchtitan:llama3:"


@st.cache_resource(show_spinner=False)
def titan_flavours() -> dict[str, dict[str, int]]:
    """torchtitan's Llama 3 flavours (``torchtitan:llama3:FLAVOUR``) and the size options the Model page
    offers for each, at their defaults. Raises ModelError when torchtitan (its supported release) is
    not installed, with the command that installs it."""
    from bonsai_core.models import torchtitan

    return {name: {**torchtitan.DEFAULTS, "layers": int(args.n_layers)}
            for name, args in torchtitan.flavours().items()}


def size_options(zoo: str | None) -> tuple[str, ...]:
    """The size options a model the app can trace again takes (a zoo name, ``hf:ARCH``, a torchtitan
    flavour or a ``hf:PATH`` config file, an uploaded config among them); none for an uploaded graph."""
    from bonsai_core.models import torchtitan

    if zoo is not None and zoo.startswith(TITAN_FAMILY):
        return torchtitan.SIZE_OPTIONS
    return tuple(size_defaults(zoo))


def size_defaults(zoo: str | None) -> dict[str, int]:
    """The size options of a model the app can trace again at their defaults (for a torchtitan flavour,
    its batch and sequence length); {} for an uploaded graph."""
    from bonsai_core.models import hf, torchtitan
    from bonsai_core.models.zoo import ZOO

    if zoo is None:
        return {}
    if zoo.startswith(TITAN_FAMILY):
        return dict(torchtitan.DEFAULTS)
    entry = ZOO.get(zoo) or hf.ARCHS.get(zoo.removeprefix(hf.PREFIX))
    if entry is None and zoo.startswith(hf.PREFIX):  # a config file (an uploaded one is kept as one)
        path = Path(zoo.removeprefix(hf.PREFIX))
        return dict(hf.read_config(hf.load_config_file(path), source=path.name).options)
    return dict(entry.options) if entry is not None else {}


CONFIG_LINK = "hf-config:"  # a link's name for an uploaded Hugging Face config: hf-config:KEY


def hf_prefix() -> str:
    from bonsai_core.models import hf

    return hf.PREFIX


@st.cache_resource(show_spinner=False, max_entries=16)
def trace_hf_config(data: bytes, filename: str, options: Options) -> Model:
    """Trace the model an uploaded Hugging Face config.json describes (parsed as JSON: no code runs),
    kept on the server (:func:`explorer.disk.store_config`) and traced as ``hf:PATH`` like any config file.

    Raises ModelError for a bad config or options."""
    from bonsai_core.models import hf

    hf.read_config(hf.parse_config(data, filename), source=filename)  # refused here, before it is stored
    return trace_stored_config(disk.store_config(data, filename), options)


@st.cache_resource(show_spinner=False, max_entries=16)
def trace_stored_config(key: str, options: Options) -> Model:
    """The model of a stored config (:func:`explorer.disk.stored_config`) traced at ``options``: ``bonsai
    trace hf:PATH``."""
    from bonsai_core.models import hf

    path = disk.stored_config(key)
    described = hf.read_config(hf.load_config_file(path), source=path.name)
    traced = trace_model(hf.PREFIX + str(path), options)
    label = f"{path.name} ({described.model_class.__name__}" + "".join(f", {k}={v}" for k, v in options) + ")"
    return replace(traced, source="hf-config", label=label, link=CONFIG_LINK + key,
                   note=f"{described.model_class.__name__} from the uploaded {path.name}, its {described.task} loss: "
                        f"the same step as `bonsai trace hf:{path.name}` with these sizes.")


@st.cache_resource(show_spinner=False, max_entries=16)
def load_upload(data: bytes, filename: str) -> Model:
    """A graph from an uploaded file: bonsai-graph JSON (parsed as data) or a torch.export ``.pt2``."""
    from explorer import loaders

    if filename.lower().endswith(".pt2"):
        from bonsai_core.models import pt2

        stem = filename.rsplit("/", 1)[-1][:-4] or "uploaded"
        graph = loaders.graph_from_pt2_bytes(data, name=stem)
        return Model(graph, "pt2", filename, note=f"Traced one training step with the loss {pt2.LOSS_DESCRIPTION}.")
    return Model(loaders.graph_from_json_bytes(data, filename), "json", filename)


# -- solving ---------------------------------------------------------------------------------------

def methods() -> list[str]:
    """The methods the sidebar offers (``solvers.available_methods``: their optional packages present)."""
    return solvers.available_methods()


def describe(method: str) -> str:
    return solvers.describe(method)


@st.cache_resource(show_spinner=False, hash_funcs=GRAPH_HASH, max_entries=16)
def no_remat(graph: Graph) -> SimResult:
    return simulate(graph, none_schedule(graph))


@st.cache_resource(show_spinner=False, hash_funcs=GRAPH_HASH, max_entries=16)
def bonsai_reach(graph: Graph) -> int | None:
    """The smallest budget bonsai meets on ``graph`` with its default options (bytes; None: not found); read
    from the disk where a sweep's child process kept it (:mod:`explorer.background`)."""
    from bonsai_core.solvers.bonsai import lowest_budget

    kept = disk.load_reach(graph.hash)
    if kept is not None:
        return kept[0]
    try:
        return lowest_budget(graph, time_limit=background.REACH_SECONDS)
    except BonsaiError:
        return None


@st.cache_resource(show_spinner=False, hash_funcs=GRAPH_HASH, max_entries=16)
def region_bound(graph: Graph) -> RegionBound:
    """The least peak of any checkpoint plan of ``graph`` (:func:`bonsai_core.regions.region_peak_bound`); read
    from the disk where a sweep's child process kept it."""
    kept = disk.load_reach(graph.hash)
    return RegionBound(*kept[1]) if kept is not None else region_peak_bound(graph)


def names_option(method: str, option: str) -> bool:
    """Whether a method's solve function declares ``option`` by name (not just ``**options``)."""
    return option in (accepted_options(method) or ())


def accepted_options(method: str) -> set[str] | None:
    """The keyword options a method declares; None when it takes any (``**options``), empty for an
    unknown method."""
    try:
        return solvers.accepted_options(method)
    except BonsaiError:
        return set()


GENERIC_OPTIONS = ("time_limit", "granularity", "backend")  # the sidebar draws these for every method
# bonsai plans checkpoint regions here (its own default also searches op-level plans, which have none):
# the pages draw, explain and export regions; its space option in the sidebar offers the others. Its search
# stops within 0.05% of one step's compute of its bound, what the overhead shown (to 0.01%) can tell apart:
# on the 8B step's plans of tiny overhead, proving 1% of it took seconds per slider position.
DEFAULTS: dict[str, dict[str, Any]] = {"bonsai": {"space": "regions", "abs_gap": 5e-4}}


def with_defaults(method: str, options: Options) -> Options:
    """``options`` with the explorer's defaults for ``method`` (:data:`DEFAULTS`) where they leave them
    out: what is solved, and what a kept plan is keyed by."""
    return tuple(sorted({**DEFAULTS.get(method, {}), **dict(options)}.items()))


@dataclass(frozen=True)
class OptionSpec:
    """One method-specific option (chen's variant, dtr's heuristic, moccasin's copies, ...)."""

    name: str
    default: Any
    kind: type = str  # bool, int, float or str
    choices: tuple | None = None  # the allowed values of a Literal option
    help: str = ""
    declared: Any = str  # the type the method declares (``solvers.MethodOption.type``)

    def parse(self, text: str) -> Any:
        """The option's value from its text in a link, as ``bonsai solve --option`` reads it
        (``solvers.parse_value``); ValueError when it is not one."""
        return solvers.parse_value(text, self.declared)


def method_options(method: str) -> tuple[OptionSpec, ...]:
    """The options ``method`` declares (``solvers.method_options``) beyond the sidebar's generic ones;
    none for an unknown method or one that takes any keyword."""
    try:
        declared = solvers.method_options(method) or ()
    except BonsaiError:
        return ()
    return tuple(_spec(o, DEFAULTS.get(method, {})) for o in declared if o.name not in GENERIC_OPTIONS)


def _spec(option: solvers.MethodOption, defaults: dict[str, Any]) -> OptionSpec:
    """The sidebar's input for one declared option, at the explorer's default where it has one: a
    ``Literal`` type gives its choices."""
    default = defaults.get(option.name, None if option.default is inspect.Parameter.empty else option.default)
    args = [a for a in typing.get_args(option.type) if a is not type(None)]
    choices = tuple(args) if typing.get_origin(option.type) is Literal else None
    kind = type(default) if default is not None else next(
        (a for a in [option.type, *args] if a in (bool, int, float)), str)
    return OptionSpec(option.name, default, kind, choices, option.help, option.type)


class Unfinished(Exception):
    """A capped solve (``solve(..., _cap=s)``) that ran into its cap: its outcome is not cached."""


def solve(graph: Graph, budget: int | None, method: str, options: Options = (), reserved: str | None = None,
          _cap: float | None = None) -> Outcome:
    """:func:`solved`, each argument passed the same way whoever calls (Streamlit's cache keys a
    default left out apart from the same value passed)."""
    return solved(graph, budget, method, tuple(options), reserved, _cap)


def kept(graph: Graph, budget: int | None, method: str, options: Options, reserved: str | None = None) -> bool:
    """Whether :func:`solve` would read this solve from the disk (:mod:`explorer.disk`) rather than solve it."""
    return disk.has_plan(graph.hash, method, with_defaults(method, options), reserved, budget)


@st.cache_resource(show_spinner=False, hash_funcs=GRAPH_HASH, max_entries=512)
def solved(graph: Graph, budget: int | None, method: str, options: Options, reserved: str | None,
           _cap: float | None) -> Outcome:
    """``solvers.solve`` with the options the user set (and the explorer's :data:`DEFAULTS`), its
    simulation, or its error message.

    ``reserved`` (an allocator policy of :data:`ALLOCATORS`) has ``budget`` bound the bytes that allocator
    reserves instead of the live bytes (``solvers.solve_reserved``, as ``bonsai solve --reserved``);
    with no budget (no remat) it only says how :func:`replay` replays the schedule, as the plans it is
    drawn beside. ``_cap`` (not part of the cache key) runs the method with its time limit lowered to ``_cap``
    wall-clock seconds (how long a page waits; the uncapped limit counts CPU seconds): a call that ends sooner is the uncapped call's outcome (the limit was never reached) and is
    cached as such; one that reaches it raises :class:`Unfinished` and nothing is cached."""
    asked = with_defaults(method, options)
    kept = disk.load_plan(graph.hash, method, asked, reserved, budget)
    if kept is not None:  # solved before, by this code (a server before this one, or its sweep): simulated again
        schedule, error, seconds = kept
        if schedule is None:
            return Outcome(method, budget, options, error=error, wall_seconds=seconds, reserved=reserved, kept=True)
        try:
            return Outcome(method, budget, options, schedule, simulate(graph, schedule), wall_seconds=seconds,
                           reserved=reserved, kept=True)
        except BonsaiError:  # not this graph's after all: solved again below
            pass
    start, cpu = time.perf_counter(), time.thread_time()
    run = dict(asked)
    if _cap is not None:
        run["time_limit"] = min(float(run.get("time_limit") or math.inf), _cap)  # 0 or absent: no limit
    try:
        # the time limit counts this thread's CPU, so that a loaded machine finds the same plans; a capped
        # solve's cap bounds how long a page waits, in wall seconds
        with cpu_seconds() if _cap is None else contextlib.nullcontext():
            if reserved is not None and budget is not None:
                schedule = solvers.solve_reserved(graph, budget, method, policy=reserved, **run)
            else:
                schedule = solvers.solve(graph, budget, method, **run)
        sim = simulated(graph, schedule)  # solvers.solve's
    except BonsaiError as e:
        outcome = Outcome(method, budget, options, error=str(e), reserved=reserved)
        keep = True
    except Exception as e:  # a solver bug or a backend failure: say so in the page, never a traceback
        keep = False
        outcome = Outcome(method, budget, options, reserved=reserved,
                          error=f"Method {method!r} failed unexpectedly ({type(e).__name__}: {e}). Try another "
                                "method or backend, and report this with the model and budget.")
    else:
        outcome = Outcome(method, budget, options, schedule, sim, reserved=reserved)
        keep = True
    outcome = replace(outcome, wall_seconds=time.perf_counter() - start,
                      cpu_seconds=time.thread_time() - cpu)
    if _cap is not None and outcome.wall_seconds >= _cap:
        raise Unfinished(f"{method} at {budget} B did not finish within {_cap:g} s")
    if keep and keepable(method, outcome, run.get("time_limit")):
        disk.save_plan(graph.hash, method, asked, reserved, budget, outcome.schedule, outcome.error,
                       outcome.wall_seconds)
    return outcome


def out_of_time(out: Outcome) -> str | None:
    """Why a plan may be worse than the method's best at its budget because its solve ran out of time, in
    words (None when it did not): status ``time_limit`` (the search ended with its fallback plan, the
    model's build perhaps eating the time) or a MIP stopped above the gap asked for."""
    from bonsai_core.solvers.bonsai import Gaps  # the registry imports the solvers lazily

    if not out.ok:
        return None
    stats = out.schedule.stats
    status, gap = stats.get("status"), stats.get("gap")
    asked, asked_abs = gaps_asked(out)
    limit = dict(out.options).get("time_limit")
    spent = ", ".join(f"{part} {seconds:.1f} s" for part, seconds in (stats.get("time_split") or {}).items()
                      if seconds >= 0.05)
    within = f" of its {limit:g} s limit" if limit else ""
    if status == "time_limit":
        plan = stats.get("fallback_plan")
        return (f"The solve ran out of time ({spent or 'the whole limit'}{within}) before its search found a plan, so "
                + (f"this is its fallback, {plan}" if plan else "this is the best it had") + ": the plan may be much "
                "worse than the method's best at this budget. Raise the time limit, or take a smaller granularity.")
    if status == "feasible" and isinstance(gap, (int, float)) and gap > asked + 1e-9 \
            and not Gaps(0.0, asked_abs).met_by(stats):
        return (f"The solve stopped at its time limit{f' ({limit:g} s)' if limit else ''} with a gap of {100 * gap:.1f}% "
                f"to its bound (asked: {100 * asked:g}%): a plan up to that much cheaper may exist at this budget. "
                "Raise the time limit for a better one.")
    return None


def gaps_asked(out: Outcome) -> tuple[float, float]:
    """(relative, absolute) MIP gap the solve of ``out`` asked for: its options, the explorer's defaults, the
    method's own (relative 1e-4, what "optimal" means everywhere, when the method declares none)."""
    declared = (solvers.method_options(out.method) or ()) if out.method in methods() else ()
    settings = {"gap": 1e-4, "abs_gap": 0.0, **{o.name: o.default for o in declared},
                **dict(with_defaults(out.method, out.options))}
    return float(settings["gap"]), float(settings["abs_gap"])


def gap_words(out: Outcome) -> str | None:
    """The gap a MIP plan was proven within, in words (relative to its overhead and in shares of the step); None
    when its stats give none or it is proven optimal."""
    stats = out.schedule.stats if out.ok else {}
    gap, objective = stats.get("gap"), stats.get("objective")
    if not isinstance(gap, (int, float)) or gap <= 0 or not isinstance(objective, (int, float)):
        return None
    return (f"within {100 * gap:.2g}% of its bound: no plan it searches at this budget is more than "
            f"{100 * gap * abs(objective):.2g}% of the step faster")


def keepable(method: str, outcome: Outcome, time_limit: float | None) -> bool:
    """Whether a solve is kept on disk: a method of bonsai_core (whose sources the store is keyed by) that
    did not run out of time (a quieter machine may do better), with a schedule or the method's own
    word on the budget; never a crash."""
    module = solvers.METHODS.get(method, ("",))[0]
    return module.startswith("bonsai_core.") and not ran_out(outcome, time_limit) and out_of_time(outcome) is None


def ran_out(outcome: Outcome, time_limit: float | None) -> bool:
    """Whether a solve used (nearly) all of its time limit, which counts the solving thread's CPU seconds."""
    return bool(time_limit) and outcome.cpu_seconds >= 0.95 * float(time_limit)


def op_costs(graph: Graph, schedule: Schedule) -> np.ndarray:
    """float64[len(ops)]: the compute time each op adds (0 for frees). O(len(ops))."""
    ids = np.fromiter((v for _, v in schedule.ops), dtype=np.int64, count=len(schedule.ops))
    is_compute = np.fromiter((k == "compute" for k, _ in schedule.ops), dtype=bool, count=len(schedule.ops))
    return np.where(is_compute, graph.cost[ids], 0.0)


# -- the module graph: its structure per graph, its boxes per fold depth ------------------------------

@st.cache_resource(show_spinner=False, hash_funcs=GRAPH_HASH, max_entries=8)
def module_structure(graph: Graph):
    """The module tree, each forward op's call, each backward op's anchor, the depth to open at and the
    block stack's paths: everything of the module view that no fold depth or schedule changes."""
    from bonsai_core.regions import block_stack
    from explorer import module_graph

    tree = module_graph.module_tree(graph)
    owners = module_graph.forward_owners(graph, tree)
    anchors = module_graph.backward_anchors(graph)
    return tree, owners, anchors, module_graph.default_depth(graph, tree), [p for p, _, _ in block_stack(graph)]


@st.cache_resource(show_spinner=False, hash_funcs=GRAPH_HASH, max_entries=32)
def boxes_at(graph: Graph, depth: int):
    """The boxes at one fold depth and their layout."""
    from explorer import module_graph

    tree, owners, anchors, _, _ = module_structure(graph)
    boxes = module_graph.module_boxes(graph, depth, tree, owners, anchors)
    return boxes, module_graph.box_layout(graph, boxes)


# -- the allocator model ---------------------------------------------------------------------------

# room for a sweep's every slider position (96) and a few more: a drag after the sweep finds its replay here
@st.cache_resource(show_spinner=False, max_entries=128,
                   hash_funcs={**GRAPH_HASH, Outcome: lambda o: (o.method, o.budget, o.options, o.reserved)})
def replay(graph: Graph, outcome: Outcome) -> Any:
    """The allocator model's replay of a solved schedule (live, reserved, fragmentation), None for a
    failed solve, or the error message. A plan solved for reserved bytes is replayed as it was bounded
    (its allocator, the fixed tensors outside the pool: ``solvers.solve_reserved``); any other in the
    full arena of PyTorch's caching allocator (``bonsai_core.allocator``'s module docstring). Kept on disk
    beside the plan (:func:`explorer.disk.save_replay`): a new server reads it instead of replaying."""
    from bonsai_core.allocator import replay_as_solved

    if outcome.schedule is None:
        return None
    settings = (graph.hash, outcome.method, with_defaults(outcome.method, outcome.options), outcome.reserved,
                outcome.budget)
    kept = disk.load_replay(*settings, outcome.schedule)
    if kept is not None:
        return kept
    try:
        result = replay_as_solved(graph, outcome.schedule)
    except BonsaiError as e:
        return str(e)
    disk.save_replay(*settings, outcome.schedule, result)
    return result


# -- what the pages draw of a plan, once per plan for every session -----------------------------------

PLAN_HASH = {**GRAPH_HASH, Outcome: lambda o: (o.method, o.budget, o.options, o.reserved)}  # as replay keys it


@st.cache_resource(show_spinner=False, hash_funcs=GRAPH_HASH, max_entries=16)
def node_modules(graph: Graph):
    """Each node's module (``explorer.timeline.node_modules``), once per graph."""
    from explorer import timeline

    return timeline.node_modules(graph)


# room for a sweep's every slider position, as replay: a drag back to a position draws what it drew
@st.cache_resource(show_spinner=False, max_entries=128, hash_funcs=PLAN_HASH)
def lifetime_bars(graph: Graph, outcome: Outcome):
    """The tensor lifetimes of a solved schedule as the Memory page's bars (``explorer.timeline.bars``)."""
    from explorer import timeline

    return timeline.bars(graph, outcome.sim.residency, node_modules(graph))


@st.cache_resource(show_spinner=False, max_entries=128, hash_funcs=PLAN_HASH)
def step_costs(graph: Graph, outcome: Outcome) -> np.ndarray:
    """:func:`op_costs` of a solved schedule, once per plan (a Python pass over every op of it)."""
    return op_costs(graph, outcome.schedule)


@st.cache_resource(show_spinner=False, max_entries=128, hash_funcs=PLAN_HASH)
def lifetime_rows(graph: Graph, outcome: Outcome, x_mode: str):
    """The lifetimes chart's rows of a solved schedule but for the step (``explorer.timeline.bar_rows``) on
    the memory chart's x axis ``x_mode``: a drag reads them, a step adds whether each bar is alive."""
    from explorer import plots, timeline

    return timeline.bar_rows(lifetime_bars(graph, outcome), plots.curve_x(step_costs(graph, outcome), x_mode),
                             graph.fixed_mem)


@dataclass(frozen=True)
class Rebuilds:
    """A solved schedule's recompute events as the pages show them: grouped into patterns, the table's rows
    of those, and the memory chart's marks (``explorer.events``)."""

    patterns: list
    pattern_rows: list[dict]
    marks: list[tuple[int, int, str]]


@st.cache_resource(show_spinner=False, max_entries=128, hash_funcs=PLAN_HASH)
def rebuilds(graph: Graph, outcome: Outcome) -> Rebuilds:
    from explorer import events

    found, modules = outcome.sim.events, node_modules(graph)
    grouped = events.patterns(graph, found, modules)
    return Rebuilds(grouped, events.pattern_rows(graph, found, grouped), events.block_marks(graph, found, modules, grouped))


@st.cache_resource(show_spinner=False, max_entries=128, hash_funcs=PLAN_HASH)
def rank_parts(graph: Graph, outcome: Outcome) -> dict:
    """One FSDP rank's memory of a solved schedule by part (``explorer.rank.breakdown``), with the allocator's
    extra when its model replays the schedule."""
    from explorer import rank

    alloc = replay(graph, outcome)
    ok = alloc is not None and not isinstance(alloc, str)
    return rank.breakdown(graph, outcome.schedule.ops, outcome.sim, alloc.reserved if ok else None,
                          alloc.live if ok else None)


# -- the same plan, compiled -------------------------------------------------------------------------

COMPILE_MODES = {"model": "torch.compile(model)", "blocks": "each block compiled (fullgraph=True), as torchtitan does"}
PARALLEL_DEGREES = ("tp", "cp", "pp")  # the explorer compiles FSDP ranks only


def compile_refusal(model: Model) -> str | None:
    """Why the compiled curve cannot be drawn for ``model``, in words; None when it can."""
    if model.zoo is None:
        return (f"This graph came from an upload ({model.label}): there is no model to compile, only its operator "
                "graph. Trace a model on the Hugging Face or torchtitan tab with the switch on.")
    parallel = [k for k in PARALLEL_DEGREES if int(model.options.get(k, 1)) > 1]
    if parallel:
        return (f"{', '.join(k.upper() for k in parallel)} > 1: the explorer draws a compiled curve for FSDP ranks "
                "only; this trace is eager only (a compiled tensor parallel rank of a torchtitan model is traced by "
                "`bonsai trace ... --tp N --compile blocks`; context and pipeline parallel ranks are not traced compiled).")
    return None


@dataclass(frozen=True)
class Compiled:
    """The compiled step of one plan: its memory over its kernels (the plain schedule of inductor's program)."""

    timeline: np.ndarray  # bytes resident after each step of the compiled program
    peak: int
    peak_op: int
    kernels: int  # nodes of the compiled graph (inductor's kernels and buffers)
    regions: tuple[str, ...]  # the checkpointed submodules the plan was laid onto
    seconds: float


def plan_key(schedule: Schedule | None) -> str:
    """What the compiled curve of a plan depends on: its checkpoint regions ("" for none: no remat, or a
    schedule of single ops)."""
    import json

    if schedule is None or "segments" not in schedule.extra:
        return ""
    return json.dumps(schedule.extra, sort_keys=True, default=str)


def compiled_step(model: Model, schedule: Schedule | None) -> Compiled | str:
    """:func:`compiled_of`, keyed by the model's spec and options and the plan's regions."""
    return compiled_of(model.zoo, tuple(sorted(model.options.items())), model.compiled, model.graph,
                       plan_key(schedule), schedule)


@st.cache_resource(show_spinner=False, hash_funcs=GRAPH_HASH, max_entries=32)
def compiled_of(spec: str, options: Options, mode: str, graph: Graph, regions: str,
                _schedule: Schedule | None) -> Compiled | str:
    """The step of ``spec`` compiled as ``mode`` says with the plan's checkpoint regions applied
    (:func:`bonsai_core.training.compiled_plan`; ``regions`` "" : without checkpoints), or why it failed."""
    from bonsai_core.training import compiled_plan

    start = time.perf_counter()
    schedule = _schedule if regions else None
    try:
        compiled, save = compiled_plan(spec, graph, schedule, mode, **dict(options))
        sim = simulate(compiled, none_schedule(compiled))
    except BonsaiError as e:
        return str(e)
    except Exception as e:  # torch.compile raises many types; the page says which, never a traceback
        return f"torch.compile could not trace {spec} ({type(e).__name__}: {(str(e).strip().splitlines() or [''])[0]})."
    return Compiled(np.asarray(sim.timeline), int(sim.peak), int(sim.peak_op), compiled.n, tuple(save),
                    time.perf_counter() - start)


# -- export ------------------------------------------------------------------------------------------

def export_zip(zoo: str, options: dict[str, int], schedule: Schedule, stem: str) -> bytes:
    """The export folder of ``schedule`` on the model ``zoo`` (``bonsai_core.export.export_model``),
    zipped under the folder name ``stem``. Raises BonsaiError as the exporter does."""
    import io
    import tempfile
    import zipfile
    from pathlib import Path

    from bonsai_core.export import export_model

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(export_model(zoo, dict(options), schedule, Path(tmp) / stem))
        buf = io.BytesIO()
        with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as z:
            for f in sorted(folder.rglob("*")):
                if f.is_file():
                    z.write(f, Path(stem) / f.relative_to(folder))
    return buf.getvalue()
