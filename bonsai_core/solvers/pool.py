"""The pool a pool-running method's schedule (``coop``, ``dtr`` with ``allocator="arena"``) ran in,
replayed block for block by the allocator model (``bonsai simulate --allocator --arena``)."""

from __future__ import annotations

from bonsai_core.allocator import AllocResult, replay
from bonsai_core.errors import BudgetError
from bonsai_core.graph import Graph
from bonsai_core.schedule import Schedule
from bonsai_core.solvers.coop import partition_sides


def pool_replay(graph: Graph, schedule: Schedule, capacity: int | None = None) -> AllocResult:
    """``schedule`` replayed in one pre-reserved pool (the ``arena`` policy) of ``capacity`` bytes in
    the budget's terms (default: the schedule's budget), set up as its method's run set up its pool:
    the full arena or not (``stats["full_arena"]``; always the full arena for a schedule that did not
    run in a pool), the optimizer's state
    (``stats["optimizer"]``, default Adam), its updates in place or copy-on-write
    (``stats["inplace_updates"]``), in-place ops in their input's block or not (``stats["inplace_writes"]``),
    and each output at the end of its block the method put it
    (coop's ``stats["partition"]``). For a schedule of a method that ran in a pool (``coop``, ``dtr``
    with ``allocator``) this is that run's pool, block for block: the same requests in the same order
    on the same deterministic allocator (``reserved_peak`` equals the run's ``pool_high_water``),
    unless the run held separated outputs resident (``stats["outputs_held"]``, rare), whose extra
    blocks the run did not place, or evicted the input of an op it had not written in place right
    after that op (rarer still: the replay then writes it in place, rule 8): then the replay is what
    the emitted schedule needs. Any
    other schedule is placed best fit, lowest address first. ``fragmentation`` is then the one the
    project reports for a pool (:func:`fragmentation_at_peak`; ``bonsai simulate --allocator --arena``).
    Raises BudgetError when the schedule has no budget and no capacity is given, or does not fit."""
    stats = schedule.stats
    if capacity is None:
        capacity = schedule.budget
    if capacity is None:
        raise BudgetError("A pool replay needs the pool's size: the schedule has no budget, so give a capacity.")
    side_of, own = None, stats.get("allocator") == "arena"
    if own and stats.get("partition", "none") != "none":
        side_of = partition_sides(graph, stats["partition"])
    full = bool(stats.get("full_arena", True)) or not own
    return replay(graph, schedule, capacity=capacity, policy="arena", full=full, optimizer=stats.get("optimizer", "adam"),
                  updates="inplace" if stats.get("inplace_updates", True) else "copy", side_of=side_of,
                  inplace_writes=bool(stats.get("inplace_writes", True)))

