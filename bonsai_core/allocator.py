"""An address-level allocator model: replay a schedule block by block, as a GPU allocator would.

The simulator counts live bytes, as if memory were a commodity. It is not: a freed block sits at an
address, and a request can only be served by one free block that is large enough. This module
models that, so that every method's schedule can be judged by the bytes an allocator must *reserve*
for it, not only by the bytes its tensors hold.

Two policies share one block structure (address-ordered blocks inside segments, split on
allocation, merged with free neighbours on free, never merged across segments):

* ``"caching"`` follows PyTorch's CUDA caching allocator (``c10/cuda/CUDACachingAllocator.cpp``)
  with its default settings: sizes rounded up to 512 B; requests of at most 1 MiB served from a
  *small* pool whose segments are 2 MiB, larger ones from a *large* pool whose segments are 20 MiB
  for requests under 10 MiB and the request rounded up to 2 MiB otherwise; best fit (smallest
  block that fits, lowest address on ties); a block is split when what is left is at least 512 B
  (small pool) or more than 1 MiB (large pool), otherwise the tensor holds the whole block. When no
  cached block fits, a new segment is reserved ("cudaMalloc") if the pool capacity allows; segments
  are never released back (no ``empty_cache``), so ``reserved`` never shrinks.
* ``"arena"`` is the one pre-reserved pool of OneFlow's DTR allocator that Coop works in
  (``oneflow/core/vm/dtr_ep_allocator.cpp``): a single segment of ``capacity - fixed_mem`` bytes,
  512-B aligned pieces, best fit, always split. A piece may be placed at the left (low) or right
  (high) end of the chosen free block, which is what cheap-tensor partitioning needs. Its
  ``reserved`` is the *high-water mark* of the addresses used (the memory that placement really
  touched), since the whole arena is reserved up front by construction.

Views allocate nothing (they share their base's storage), nor do zero-byte outputs. ``fixed_mem``
(parameters, gradients, optimizer state, the batch) is counted as one block outside the model:
it is added to ``live`` and ``reserved`` alike, so the numbers compare with the simulator's.

A multi-output op is one block of its outputs' total size (the graph stores only the sum); a real
allocator gives each output its own block, so this slightly under-counts rounding waste.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator, Literal

import numpy as np

from bonsai_core.budget import format_bytes
from bonsai_core.errors import BudgetError
from bonsai_core.graph import Graph
from bonsai_core.schedule import COMPUTE, FREE, Schedule, simulate

MIN_BLOCK = 512  # kMinBlockSize: every size is rounded up to a multiple of this
SMALL_SIZE = 2**20  # kSmallSize: largest request of the small pool
SMALL_BUFFER = 2 * 2**20  # kSmallBuffer: segment size of the small pool
LARGE_BUFFER = 20 * 2**20  # kLargeBuffer: segment size for large requests below MIN_LARGE_ALLOC
MIN_LARGE_ALLOC = 10 * 2**20  # kMinLargeAlloc
ROUND_LARGE = 2 * 2**20  # kRoundLarge: larger requests reserve their size rounded up to this

Policy = Literal["caching", "arena"]
Side = Literal["left", "right"]


def round_size(nbytes: int) -> int:
    """The block size a request of ``nbytes`` takes: at least 512 B, a multiple of 512 B."""
    return MIN_BLOCK if nbytes < MIN_BLOCK else MIN_BLOCK * -(-int(nbytes) // MIN_BLOCK)


def segment_size(size: int) -> int:
    """Bytes the caching allocator reserves for a new segment serving a rounded request ``size``."""
    if size <= SMALL_SIZE:
        return SMALL_BUFFER
    if size < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return ROUND_LARGE * -(-size // ROUND_LARGE)


class Block:
    """A contiguous range ``[addr, addr + size)`` of one segment; ``owner`` is the node held, or -1."""

    __slots__ = ("addr", "size", "owner", "segment", "prev", "next")

    def __init__(self, addr: int, size: int, segment: int) -> None:
        self.addr, self.size, self.owner, self.segment = addr, size, -1, segment
        self.prev: Block | None = None
        self.next: Block | None = None

    @property
    def free(self) -> bool:
        return self.owner < 0

    def __repr__(self) -> str:
        return f"Block(addr={self.addr}, size={self.size}, owner={self.owner}, segment={self.segment})"


class Allocator:
    """A mutable allocator state: segments of address-ordered blocks.

    ``capacity`` bounds the bytes reserved for tensors (the caller subtracts ``fixed_mem``); None is
    unbounded (caching policy only). Every operation is O(number of blocks), which is at most a few
    thousand for the graphs of this tool.
    """

    def __init__(self, capacity: int | None = None, policy: Policy = "caching") -> None:
        if policy not in ("caching", "arena"):
            raise ValueError(f"unknown allocator policy {policy!r}")
        if policy == "arena" and capacity is None:
            raise ValueError("the arena policy needs a capacity")
        self.policy: Policy = policy
        self.capacity = capacity
        self.heads: list[Block] = []  # first block of each segment; segment i starts at addr of heads[i]
        self.pools: list[str] = []  # pool of each segment
        self.free_blocks: dict[str, set[Block]] = {"small": set(), "large": set(), "arena": set()}
        self.by_owner: dict[int, Block] = {}
        self.reserved = 0
        self.allocated = 0  # bytes of blocks held by owners (rounded sizes, whole unsplit blocks)
        self.high_water = 0  # highest address end ever held, relative to the first segment
        self._next_addr = 0
        if policy == "arena":
            arena = (capacity // MIN_BLOCK) * MIN_BLOCK
            if arena > 0:
                self._add_segment(arena, "arena")

    # -- segments ------------------------------------------------------------------------------

    def _add_segment(self, size: int, pool: str) -> Block:
        block = Block(self._next_addr, size, len(self.heads))
        # a gap of one block between segments: two segments are never contiguous
        self._next_addr += size + MIN_BLOCK
        self.heads.append(block)
        self.pools.append(pool)
        self.free_blocks[pool].add(block)
        self.reserved += size
        return block

    def blocks(self) -> Iterator[Block]:
        """Every block, in address order."""
        for head in self.heads:
            b: Block | None = head
            while b is not None:
                yield b
                b = b.next

    def segments(self) -> Iterator[list[Block]]:
        """The blocks of each segment, in address order (Coop's window never crosses a segment)."""
        for head in self.heads:
            out, b = [], head
            while b is not None:
                out.append(b)
                b = b.next
            yield out

    def pool_of(self, size: int) -> str:
        if self.policy == "arena":
            return "arena"
        return "small" if size <= SMALL_SIZE else "large"

    # -- allocation ----------------------------------------------------------------------------

    def _should_split(self, pool: str, remaining: int) -> bool:
        if pool == "large":
            return remaining > SMALL_SIZE
        return remaining >= MIN_BLOCK

    def find_block(self, size: int, side: Side = "left") -> Block | None:
        """Best fit among the cached free blocks of the request's pool; on ties, the lowest address
        (``side="left"``) or the highest (``"right"``)."""
        pool = self.pool_of(size)
        best: Block | None = None
        for b in self.free_blocks[pool]:
            if b.size >= size and (best is None or b.size < best.size
                                   or (b.size == best.size and (b.addr < best.addr) == (side == "left"))):
                best = b
        return best

    def can_grow(self, size: int) -> bool:
        if self.policy == "arena":
            return False
        return self.capacity is None or self.reserved + segment_size(size) <= self.capacity

    def malloc(self, owner: int, nbytes: int, side: Side = "left") -> Block | None:
        """Give ``owner`` a block of ``nbytes`` (rounded); None when nothing fits and no segment can
        be reserved within the capacity (the caller then evicts, or it is out of memory)."""
        if owner in self.by_owner:
            raise ValueError(f"node {owner} already holds a block")
        size = round_size(nbytes)
        block = self.find_block(size, side)
        if block is None:
            if not self.can_grow(size):
                return None
            block = self._add_segment(segment_size(size), self.pool_of(size))
        return self._take(block, size, owner, side)

    def _take(self, block: Block, size: int, owner: int, side: Side) -> Block:
        pool = self.pools[block.segment]
        self.free_blocks[pool].discard(block)
        remaining = block.size - size
        if self._should_split(pool, remaining):
            rest = Block(block.addr, remaining, block.segment)
            if side == "left":
                rest.addr = block.addr + size
                rest.prev, rest.next = block, block.next
                if block.next is not None:
                    block.next.prev = rest
                block.next = rest
            else:  # the piece goes to the right end; the rest stays at the left
                rest.prev, rest.next = block.prev, block
                if block.prev is not None:
                    block.prev.next = rest
                else:
                    self.heads[block.segment] = rest
                block.prev = rest
                block.addr += remaining
            block.size = size
            self.free_blocks[pool].add(rest)
        block.owner = owner
        self.by_owner[owner] = block
        self.allocated += block.size
        self.high_water = max(self.high_water, block.addr + block.size - self.heads[0].addr)
        return block

    def free(self, owner: int) -> None:
        """Return ``owner``'s block to its pool, merged with free neighbours of its segment."""
        block = self.by_owner.pop(owner)
        self.allocated -= block.size
        block.owner = -1
        pool = self.free_blocks[self.pools[block.segment]]
        for nb in (block.prev, block.next):
            if nb is not None and nb.free:
                pool.discard(nb)
                lo, hi = (nb, block) if nb is block.prev else (block, nb)
                lo.size += hi.size
                lo.next = hi.next
                if hi.next is not None:
                    hi.next.prev = lo
                block = lo
        pool.add(block)

    @property
    def largest_free(self) -> int:
        return max((b.size for s in self.free_blocks.values() for b in s), default=0)

    @property
    def footprint(self) -> int:
        """Reserved bytes as this model reports them: segments (caching) or the high-water mark (arena)."""
        return self.high_water if self.policy == "arena" else self.reserved


@dataclass(frozen=True)
class AllocResult:
    """Per-op allocator state of a replayed schedule (all byte counts include ``fixed_mem``).

    ``live[i]``: bytes of live tensors after op i (the simulator's timeline); ``reserved[i]``: bytes
    the allocator holds after op i; ``largest_free[i]``: its largest free block after op i.
    ``fragmentation`` = 1 - live / reserved at the reserved peak (see :func:`fragmentation_at_peak`).
    """

    live: np.ndarray
    reserved: np.ndarray
    largest_free: np.ndarray
    peak: int
    reserved_peak: int
    fragmentation: float
    policy: str = "caching"
    segments: int = 0

    def stats(self) -> dict[str, Any]:
        return {"peak": self.peak, "reserved_peak": self.reserved_peak, "fragmentation": self.fragmentation,
                "waste": self.reserved_peak - self.peak, "segments": self.segments, "allocator": self.policy}


def fragmentation_at_peak(live: np.ndarray, reserved: np.ndarray) -> float:
    """1 - live / reserved at the reserved peak: the share of the reserved bytes that the tensors
    cannot use when they need the most of them. ``reserved`` never shrinks in this model, so the
    peak is a plateau from the op that first reaches it to the end; the live bytes taken are the
    most live bytes on that plateau (0 for an empty schedule)."""
    if len(reserved) == 0 or reserved.max() <= 0:
        return 0.0
    i = int(np.argmax(reserved))
    top = reserved[i]
    on_plateau = reserved[i:] == top
    return float(1.0 - live[i:][on_plateau].max() / top)


def replay(graph: Graph, schedule: Schedule | list[tuple[str, int]], capacity: int | None = None,
           policy: Policy = "caching") -> AllocResult:
    """Replay a schedule (validated by the simulator first) through the allocator model.

    ``capacity`` is the pool's size in the budget's terms (``fixed_mem`` included): with the caching
    policy no segment may take ``reserved`` past it; the arena policy needs it. Raises BudgetError at
    the first request that cannot be served within it, and ScheduleError for an invalid schedule.
    O(len(ops) * blocks).
    """
    sim = simulate(graph, schedule)
    ops = schedule.ops if isinstance(schedule, Schedule) else schedule
    fixed = graph.fixed_mem
    if capacity is not None and capacity < fixed:
        raise BudgetError(f"A pool of {format_bytes(capacity)} cannot even hold {graph.name!r}'s fixed memory "
                          f"({format_bytes(fixed)}); raise it.")
    if policy == "arena" and capacity is None:
        raise BudgetError("The arena allocator is one pre-reserved pool: give it a capacity (a budget).")
    alloc = Allocator(None if capacity is None else capacity - fixed, policy)
    mem = graph.mem.tolist()
    holds = (graph.mem > 0) & ~graph.is_view
    reserved = np.empty(len(ops), dtype=np.int64)
    largest = np.empty(len(ops), dtype=np.int64)
    for i, (kind, v) in enumerate(ops):
        if kind == COMPUTE and holds[v]:
            if alloc.malloc(v, mem[v]) is None:
                raise BudgetError(
                    f"The allocator runs out of its {format_bytes(capacity)} pool at op {i} (computing node {v}, "
                    f"{graph.names[v]!r}, {format_bytes(mem[v])}): {format_bytes(alloc.footprint + fixed)} is in use "
                    f"and its largest free block is {format_bytes(alloc.largest_free)}. Replay without a capacity "
                    "to see the reserved peak this schedule needs.")
        elif kind == FREE and holds[v]:
            alloc.free(v)
        reserved[i] = alloc.footprint + fixed
        largest[i] = alloc.largest_free
    return AllocResult(live=sim.timeline, reserved=reserved, largest_free=largest, peak=sim.peak,
                       reserved_peak=int(reserved.max()) if len(reserved) else fixed,
                       fragmentation=fragmentation_at_peak(sim.timeline, reserved), policy=policy,
                       segments=len(alloc.heads))

