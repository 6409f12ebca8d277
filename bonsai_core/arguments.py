"""The argument types of the ``bonsai`` command and its benchmark suites (argparse ``type=`` callables:
each turns a bad value into argparse's one-line error, exit status 2), and the rules that tie its
options together (:func:`reserved_policy`, :func:`solve_time_limit`)."""

from __future__ import annotations

import argparse
from typing import Callable

from bonsai_core.budget import Budget, parse_budget
from bonsai_core.errors import BonsaiError, BudgetError

# what torch.compile wraps: the whole model (``torch.compile(model)``), or each block of its block stack
# with ``fullgraph=True`` (torchtitan's ``apply_compile``, after activation checkpointing)
COMPILE_MODES = ("model", "blocks")
# activation checkpointing applied before compiling, as the run applies it: torchtitan's own ``apply_ac``
# (``full``; ``selective``, op-level, with the save list of its 0.2.2 release or of December 2024), or
# torch's memory budget for the partitioner's knapsack (``budget:F``, ``activation_memory_budget = F``)
CHECKPOINTING = ("torchtitan-full", "torchtitan-selective", "torchtitan-selective-2024-12", "budget:F")
# the devices whose kernels a trace can record: dropout's, attention-with-dropout's, and under compile the
# partitioner's compute-intensive ops (:mod:`bonsai_core.trace.patches`, :func:`bonsai_core.trace.compiled.partitioner_for`)
KERNELS = ("cuda", "cpu")
SOLVE_TIME_LIMIT = 60.0  # seconds, `bonsai solve`'s default (the bench's too): an exact method never hangs unseen


def budget_arg(text: str) -> Budget:
    """A budget as ``parse_budget`` reads it: bytes, a size (``2GiB``) or a share (``60%``)."""
    try:
        return parse_budget(text)
    except BudgetError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def positive(unit: str, or_zero: bool = False) -> Callable[[str], float]:
    """An argparse type: a finite number above 0 (or 0 itself, with ``or_zero``), ``unit`` naming
    what it counts in the error."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = float("nan")
        if not (value >= 0 if or_zero else value > 0) or value == float("inf"):
            raise argparse.ArgumentTypeError(f"{text!r} is not a {'' if or_zero else 'positive '}number{unit}")
        return value
    return parse


positive_seconds = positive(" of seconds")
time_limit_arg = positive(" of seconds (0 for no limit)", or_zero=True)


def positive_int(text: str) -> int:
    """A whole number above 0 (a model's size option)."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive whole number")
    return value


def fraction_arg(text: str) -> float:
    """A bench budget: a share of the no-remat peak (``70`` or ``70%``) as a fraction (0.7)."""
    value = budget_arg(text if text.strip().endswith("%") else text + "%")
    if value.fraction is None:
        raise argparse.ArgumentTypeError(f"{text!r}: bench budgets are shares of the no-remat peak, like 70 or 70%")
    if value.fraction < 0.01:  # no schedule gets under the fixed memory; 0.8 was meant as 80%
        raise argparse.ArgumentTypeError(f"{text!r} reads as {value}: bench budgets are percentages of the no-remat "
                                         "peak, like 70 or 70%")
    return value.fraction


def bench_budget_arg(text: str) -> Budget:
    """A bench budget where a suite also takes bytes: a share of the no-remat peak as every suite writes it
    (``70`` or ``70%``, :func:`fraction_arg`), or bytes with a unit (``82.4GiB``)."""
    if text.strip().rstrip("%").replace(".", "", 1).isdigit():
        return Budget(fraction=fraction_arg(text))
    value = budget_arg(text)
    if value.bytes is None:
        raise argparse.ArgumentTypeError(f"{text!r}: a bench budget is a percentage (70 or 70%) or bytes with a unit")
    return value


def overhead_arg(text: str) -> float:
    """A largest recompute overhead: a percentage (``10%`` or ``10``) as a fraction (0.1), 0 or more.
    Not :func:`fraction_arg`: an overhead is no budget, and 0% (no recomputation) is a limit."""
    try:
        value = float(text.strip().removesuffix("%")) / 100
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a percentage like 10%") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: an overhead limit is >= 0%")
    return value


def true_or_false(text: str) -> bool:
    """true/yes/1 or false/no/0, any case."""
    if text.lower() in ("true", "yes", "1"):
        return True
    if text.lower() in ("false", "no", "0"):
        return False
    raise argparse.ArgumentTypeError(f"{text!r} is not true or false")


# ``--reshard-after-forward``: one flag for every block, or how torchtitan applies ``fully_shard``
# (bonsai_core.fsdp.fsdp_units): "all-but-last" as in December 2024, "torchtitan" as release 0.2.2 does
ALL_BUT_LAST, TORCHTITAN = "all-but-last", "torchtitan"
RESHARD_CHOICES = ("true", "false", ALL_BUT_LAST, TORCHTITAN)
# --pp-schedule: torch.distributed.pipelining's schedule classes, by the names the command line takes
SCHEDULES = {"1f1b": "1F1B", "interleaved-1f1b": "Interleaved1F1B"}


def reshard_arg(text: str) -> bool | str:
    """``--reshard-after-forward``: true, false, all-but-last or torchtitan (a value, not a flag pair: the
    default depends on the model, and the last two are further choices)."""
    return text.lower() if text.lower() in (ALL_BUT_LAST, TORCHTITAN) else true_or_false(text)


def solve_time_limit(seconds: float | None) -> float | None:
    """The time limit a solve runs under, from ``--time-limit`` or ``--option time_limit`` (the caller's
    default :data:`SOLVE_TIME_LIMIT` when neither is given): 0 means no limit (None), as in the app."""
    return None if seconds == 0 else seconds


def allocator_policy(args: argparse.Namespace) -> str:
    """The allocator model the options choose: "expandable" with ``--expandable-segments``, else "caching"."""
    return "expandable" if args.expandable_segments else "caching"


def reserved_policy(args: argparse.Namespace) -> str | None:
    """The allocator model whose reserved bytes ``--reserved`` budgets (:func:`allocator_policy`), None
    without ``--reserved``; ``--expandable-segments`` without it is a BonsaiError."""
    if args.expandable_segments and not args.reserved:
        raise BonsaiError("--expandable-segments models the allocator whose reserved bytes --reserved budgets; "
                          "give --reserved too.")
    return allocator_policy(args) if args.reserved else None
