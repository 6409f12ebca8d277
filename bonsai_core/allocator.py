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
  cached block fits, a new segment is reserved ("cudaMalloc") if the pool capacity allows; if it does
  not, every cached segment that holds no tensor is released and the request retried (PyTorch's
  release-and-retry on OOM). Without a capacity nothing is ever released, so ``reserved`` never
  shrinks.
* ``"arena"`` is the one pre-reserved pool of OneFlow's DTR allocator that Coop works in
  (``oneflow/core/vm/dtr_ep_allocator.cpp``): a single segment of ``capacity - fixed_mem`` bytes,
  512-B aligned pieces, best fit, always split. A piece may be placed at the left (low) or right
  (high) end of the chosen free block, which is what cheap-tensor partitioning needs. Its
  ``reserved`` is the *high-water mark* of the addresses used (the memory that placement really
  touched), since the whole arena is reserved up front by construction.

* ``"expandable"`` follows the same allocator with ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``
  (what large training runs set): each pool is one segment of virtual address space that grows by
  mapping pages (2 MiB in the small pool, 20 MiB in the large one, ``ExpandableSegment``'s page
  sizes) at its end or into unmapped holes; ``reserved`` counts mapped pages only. A request takes
  the best-fitting free mapped block (preferring, among blocks that fit, one that does not border
  unmapped space, as ``get_free_block`` does), else the lowest-addressed run of free and unmapped
  space that fits (``find_expandable_block``), mapping the pages it lacks. Blocks split whenever at
  least 512 B remain. On a capacity miss every page lying wholly inside a free block is unmapped
  (``release_cached_blocks`` -> ``unmap_block``) and the request retried. So a freed hole is reused
  by any later request that fits it, and the segment-size rounding of the default policy disappears.

Views allocate nothing (they share their base's storage), nor do zero-byte outputs. ``fixed_mem``
(parameters, gradients, optimizer state, the batch) is counted as one block outside the model:
it is added to ``live`` and ``reserved`` alike, so the numbers compare with the simulator's.

A multi-output op is one block of its outputs' total size (the graph stores only the sum); a real
allocator gives each output its own block, so this slightly under-counts rounding waste.

**The full arena** (``full=True``): the fixed tensors live in the same address space as the
activations, allocated in a real training loop's order (:func:`pin_fixed`), so pinned blocks sit
between the free ranges that activations use: parameters (at model construction), their gradient
buffers (``zeros_like`` before the first step, as :func:`bonsai_core.measure.allocate_fixed` does),
the batch, then, after the first step has run and freed its activations, the optimizer state (Adam's
``exp_avg`` and ``exp_avg_sq`` per parameter, allocated by the first ``optimizer.step()``), then the
next step's batch (loaded before the previous one is dropped, leaving a batch-sized hole). The
measured step is that steady-state second step. The tensors come from the graph's optional
``fixed_tensors`` field (name, bytes, kind of each, written by ``bonsai trace``); for a graph without
it they are derived (:func:`fixed_tensors`): one parameter and one gradient per parameter-gradient
output of the backward pass (in reverse backward order, which is the model's parameter order), and
the rest of ``fixed_mem`` (buffers, frozen parameters, the batch) as one batch block. (The
derivation misses gradients that are not separate outputs, such as a convolution's weight gradient
inside ``convolution_backward``'s one node, so it under-counts the optimizer state of conv nets.) Optimizer state
is not part of the simulator's ``fixed_mem``: with the full arena the pool holds ``capacity`` plus
the optimizer state, and ``live`` counts it, so the budget keeps its meaning for every method.
``updates="copy"`` replays the first ``optimizer.step()`` as copy-on-write (each parameter, then each
optimizer state, in order: a new block, then the old one freed), so the pinned tensors the measured
step works around have moved; ``"inplace"`` (the default) keeps them where they were allocated: Coop's
*recomputable in-place*, which lets the optimizer update unevictable tensors in place.
**Streams.** PyTorch keeps free blocks per stream (``BlockPool`` ordered by (stream, size); a request
is served only from its stream's blocks, and with expandable segments each stream grows a segment of
its own): pools here are a size class on a stream (``"large@reduce_scatter"``). The step's ops run on the
compute stream; on an FSDP rank FSDP2's buffers are replayed on FSDP2's streams
(:func:`bonsai_core.fsdp.buffer_events`: all-gather outputs on the copy-in stream, reduce-scatter outputs
on the reduce-scatter stream, the unsharded parameters and reduce-scatter inputs on the compute stream),
so what one stream freed is not reused by another. FSDP2 keeps a buffer alive until the consuming
stream is done with it instead of ``record_stream`` (``all_gather_state``, ``reduce_scatter_states``),
which the events follow. **The optimizer step's temporaries** (:data:`bonsai_core.optimizer.STEP_TEMPORARIES`:
AdamW's ``_foreach_sqrt``, one tensor per parameter) are allocated after the last op, then freed.
Still not modelled: garbage collection thresholds, the optimizer step's small allocations (``step``
counters, norms), and library workspaces (cuBLAS, the flash kernel's backward accumulators).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Literal

import numpy as np

from bonsai_core.errors import BudgetError
from bonsai_core.graph import Graph
from bonsai_core.schedule import COMPUTE, FREE, NO_COPIES, RELOAD, CopyTiming, Schedule, inplace_writes, simulate, timing_of
from bonsai_core.units import format_bytes

MIN_BLOCK = 512  # kMinBlockSize: every size is rounded up to a multiple of this
SMALL_SIZE = 2**20  # kSmallSize: largest request of the small pool
SMALL_BUFFER = 2 * 2**20  # kSmallBuffer: segment size of the small pool
LARGE_BUFFER = 20 * 2**20  # kLargeBuffer: segment size for large requests below MIN_LARGE_ALLOC
MIN_LARGE_ALLOC = 10 * 2**20  # kMinLargeAlloc
ROUND_LARGE = 2 * 2**20  # kRoundLarge: larger requests reserve their size rounded up to this

DEFAULT_STREAM = "compute"  # the stream the step's ops run on (bonsai_core.fsdp.COMPUTE_STREAM)

Policy = Literal["caching", "arena", "expandable"]
POLICIES = ("caching", "arena", "expandable")
# ExpandableSegment's page size per pool (kSmallBuffer, kLargeBuffer), and the virtual size of a pool's
# one segment in this model: larger than any device, a multiple of both pages.
PAGE = {"small": SMALL_BUFFER, "large": LARGE_BUFFER}
VIRTUAL = LARGE_BUFFER * 2**22
Optimizer = Literal["adam", "sgd"]
# How the optimizer writes parameters and its state: in place (the tensors keep their addresses; Coop's
# recomputable in-place) or copy-on-write (a new block, then the old one freed: how a rematerializing
# runtime keeps a mutated tensor's old value recomputable without it).
Updates = Literal["inplace", "copy"]
OPTIMIZER_STATES = {"adam": ("exp_avg", "exp_avg_sq"), "sgd": ()}  # per parameter, allocation order
Side = Literal["left", "right"]


def _size_class(pool: str) -> str:
    """"small", "large" or "arena": a pool's size class, whatever its stream."""
    return pool.partition("@")[0]


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

    __slots__ = ("addr", "size", "owner", "segment", "prev", "next", "mapped")

    def __init__(self, addr: int, size: int, segment: int, mapped: bool = True) -> None:
        self.addr, self.size, self.owner, self.segment = addr, size, -1, segment
        self.prev: Block | None = None
        self.next: Block | None = None
        self.mapped = mapped  # False only for the not-yet-mapped address space of an expandable segment

    @property
    def free(self) -> bool:
        return self.owner < 0

    @property
    def usable(self) -> bool:
        """Free and mapped: a block a request can take as it is."""
        return self.owner < 0 and self.mapped

    def __repr__(self) -> str:
        return f"Block(addr={self.addr}, size={self.size}, owner={self.owner}, segment={self.segment})"


class Allocator:
    """A mutable allocator state: segments of address-ordered blocks.

    ``capacity`` bounds the bytes reserved for tensors (the caller subtracts ``fixed_mem``); None is
    unbounded (caching policy only). Every operation is O(number of blocks), which is at most a few
    thousand for the graphs of this tool.
    """

    def __init__(self, capacity: int | None = None, policy: Policy = "caching") -> None:
        if policy not in POLICIES:
            raise ValueError(f"unknown allocator policy {policy!r}; use one of {', '.join(POLICIES)}")
        if policy == "arena" and capacity is None:
            raise ValueError("the arena policy needs a capacity")
        self.policy: Policy = policy
        self.capacity = capacity
        self.heads: list[Block | None] = []  # first block of each segment (None once released)
        self.pools: list[str] = []  # pool of each segment
        # free blocks per pool; a pool is a size class on one stream ("large", "large@reduce_scatter"): the
        # caching allocator keeps blocks per stream and serves a request only from its stream's blocks
        self.free_blocks: dict[str, set[Block]] = defaultdict(set)
        self.by_owner: dict[int, Block] = {}
        self.reserved = 0
        self.allocated = 0  # bytes of blocks held by owners (rounded sizes, whole unsplit blocks)
        self.high_water = 0  # highest address end ever held, relative to the first segment
        self.pinned_bytes = 0  # bytes of fixed tensors placed in the pool (the full arena), else 0
        self._next_addr = 0
        self.expandable: dict[str, int] = {}  # pool -> its one segment (expandable policy: one per stream too)
        if policy == "arena":
            arena = (capacity // MIN_BLOCK) * MIN_BLOCK
            if arena > 0:
                self._add_segment(arena, "arena")

    # -- segments ------------------------------------------------------------------------------

    def _add_segment(self, size: int, pool: str, mapped: bool = True) -> Block:
        block = Block(self._next_addr, size, len(self.heads), mapped)
        # a gap between segments: two segments are never contiguous (a page, keeping pages aligned)
        self._next_addr += size + (LARGE_BUFFER if self.policy == "expandable" else MIN_BLOCK)
        self.heads.append(block)
        self.pools.append(pool)
        if mapped:
            self.free_blocks[pool].add(block)
            self.reserved += size
        return block

    def blocks(self) -> Iterator[Block]:
        """Every mapped block, in address order."""
        for head in self.heads:
            b: Block | None = head  # None: a released segment
            while b is not None:
                if b.mapped:
                    yield b
                b = b.next

    def segments(self) -> Iterator[list[Block]]:
        """The blocks of each segment, in address order (Coop's window never crosses a segment)."""
        for head in self.heads:
            if head is None:  # released
                continue
            out, b = [], head
            while b is not None:
                out.append(b)
                b = b.next
            yield out

    def pool_of(self, size: int, stream: str = DEFAULT_STREAM) -> str:
        """The pool a request is served from: its size class, on its stream (``get_pool`` and the
        ``BlockPool``'s (stream, size) order in ``c10/cuda/CUDACachingAllocator.cpp``)."""
        if self.policy == "arena":
            return "arena"
        size_class = "small" if size <= SMALL_SIZE else "large"
        return size_class if stream == DEFAULT_STREAM else f"{size_class}@{stream}"

    # -- allocation ----------------------------------------------------------------------------

    def _should_split(self, pool: str, remaining: int) -> bool:
        if _size_class(pool) == "large" and self.policy == "caching":
            return remaining > SMALL_SIZE
        return remaining >= MIN_BLOCK

    def find_block(self, size: int, side: Side = "left", stream: str = DEFAULT_STREAM) -> Block | None:
        """Best fit among the cached free blocks of the request's pool (on its stream); on ties, the
        lowest address (``side="left"``) or the highest (``"right"``)."""
        pool = self.pool_of(size, stream)
        if self.policy == "expandable":
            return self._find_expandable_fit(pool, size)
        best: Block | None = None
        for b in self.free_blocks[pool]:
            if b.size >= size and (best is None or b.size < best.size
                                   or (b.size == best.size and (b.addr < best.addr) == (side == "left"))):
                best = b
        return best

    def _find_expandable_fit(self, pool: str, size: int) -> Block | None:
        """``get_free_block`` with expandable segments: the smallest mapped free block that fits,
        except that a block bordering unmapped space counts as the size it could grow to, so the
        walk up the size order moves past it to a block that can grow less."""
        def growable(b: Block) -> int:
            return b.size + (b.next.size if b.next is not None and not b.next.mapped else 0)

        fits = sorted((b for b in self.free_blocks[pool] if b.size >= size), key=lambda b: (b.size, b.addr))
        if not fits:
            return None
        i = 0
        while i + 1 < len(fits) and growable(fits[i + 1]) < growable(fits[i]):
            i += 1
        return fits[i]

    # -- expandable segments -------------------------------------------------------------------

    def _expandable_run(self, pool: str, size: int) -> Block:
        """``find_expandable_block``: the lowest-addressed unmapped block (started at the free
        mapped block right before it, if any) followed by free or unmapped space of ``size`` bytes."""
        if pool not in self.expandable:
            self.expandable[pool] = self._add_segment(VIRTUAL, pool, mapped=False).segment
        b: Block | None = self.heads[self.expandable[pool]]
        while b is not None:
            if not b.mapped:
                start = b.prev if b.prev is not None and b.prev.usable else b
                room, c = 0, start
                while c is not None and room < size and c.free:
                    room, c = room + c.size, c.next
                if room >= size:
                    return start
            b = b.next
        raise AssertionError("an expandable segment always ends in unmapped space")

    def _pages_to_map(self, start: Block, size: int) -> int:
        """Bytes of pages that taking ``size`` bytes from ``start`` on must map."""
        page, need, b, covered = PAGE[_size_class(self.pools[start.segment])], 0, start, 0
        while covered < size:
            assert b is not None
            if b.mapped:
                covered += b.size
            else:
                mapped = min(b.size, page * -(-(size - covered) // page))
                need, covered = need + mapped, covered + mapped
            b = b.next
        return need

    def _map(self, block: Block, nbytes: int) -> Block:
        """Map the first ``nbytes`` (whole pages) of unmapped ``block``; merge them with free mapped
        neighbours and return the resulting free block."""
        pool = self.pools[block.segment]
        if nbytes < block.size:
            rest = Block(block.addr + nbytes, block.size - nbytes, block.segment, mapped=False)
            rest.prev, rest.next = block, block.next
            if block.next is not None:
                block.next.prev = rest
            block.next = rest
            block.size = nbytes
        block.mapped = True
        self.reserved += nbytes
        return self._merge_free(block, self.free_blocks[pool])

    def _grow(self, pool: str, size: int) -> Block | None:
        """``try_allocate_expandable_block``: map the pages a request lacks, within the capacity."""
        start = self._expandable_run(pool, size)
        if self.capacity is not None and self.reserved + self._pages_to_map(start, size) > self.capacity:
            return None
        page, block = PAGE[_size_class(pool)], start
        while True:
            if not block.mapped:
                block = self._map(block, min(block.size, page * -(-size // page)))
            if block.size >= size:
                return block
            assert block.next is not None and not block.next.mapped
            lacking = size - block.size
            block = self._map(block.next, min(block.next.size, page * -(-lacking // page)))

    def _unmap_free_pages(self) -> int:
        """``unmap_block`` on every free mapped block: the pages wholly inside it are unmapped."""
        released = 0
        for pool, segment in self.expandable.items():
            page, base = PAGE[_size_class(pool)], self.heads[segment].addr
            for b in [b for b in self.free_blocks[pool]]:
                lo = base + page * -(-(b.addr - base) // page)
                hi = base + page * ((b.addr + b.size - base) // page)
                if hi <= lo:
                    continue
                self.free_blocks[pool].discard(b)
                parts = [(b.addr, lo - b.addr, True), (lo, hi - lo, False), (hi, b.addr + b.size - hi, True)]
                prev, nxt, first = b.prev, b.next, None
                for addr, size, mapped in parts:
                    if size == 0:
                        continue
                    piece = Block(addr, size, segment, mapped)
                    piece.prev = prev
                    if prev is not None:
                        prev.next = piece
                    first = first or piece
                    prev = piece
                    if mapped:
                        self.free_blocks[pool].add(piece)
                prev.next = nxt
                if nxt is not None:
                    nxt.prev = prev
                if first.prev is None:
                    self.heads[segment] = first
                self.reserved -= hi - lo
                released += hi - lo
            self._merge_unmapped(segment)
        return released

    def _merge_unmapped(self, segment: int) -> None:
        b = self.heads[segment]
        while b is not None and b.next is not None:
            if not b.mapped and not b.next.mapped:
                gone = b.next
                b.size += gone.size
                b.next = gone.next
                if gone.next is not None:
                    gone.next.prev = b
            else:
                b = b.next

    def can_grow(self, size: int) -> bool:
        if self.policy == "arena":
            return False
        return self.capacity is None or self.reserved + segment_size(size) <= self.capacity

    def malloc(self, owner: int, nbytes: int, side: Side = "left", stream: str = DEFAULT_STREAM) -> Block | None:
        """Give ``owner`` a block of ``nbytes`` (rounded) from ``stream``'s pools; None when nothing fits
        and no segment can be reserved within the capacity (the caller then evicts, or it is out of memory)."""
        if owner in self.by_owner:
            raise ValueError(f"node {owner} already holds a block")
        size = round_size(nbytes)
        block = self.find_block(size, side, stream)
        if block is None and self.policy == "expandable":
            pool = self.pool_of(size, stream)
            block = self._grow(pool, size)
            if block is None:
                self.release_cached()
                block = self._grow(pool, size)
                if block is None:
                    return None
        if block is None:
            if not self.can_grow(size):
                self.release_cached()  # PyTorch's release-and-retry
                if not self.can_grow(size):
                    return None
            block = self._add_segment(segment_size(size), self.pool_of(size, stream))
        return self._take(block, size, owner, side)

    def release_cached(self) -> int:
        """PyTorch's release-and-retry on OOM: give back every cached segment that holds no tensor
        (``release_cached_blocks``, as ``empty_cache`` does); returns the bytes released. Only the
        caching policy releases (with expandable segments: the pages wholly inside free blocks); the
        arena is one pool."""
        if self.policy == "expandable":
            return self._unmap_free_pages()
        if self.policy != "caching":
            return 0
        released = 0
        for i, head in enumerate(self.heads):
            if head is not None and head.free and head.next is None:
                self.free_blocks[self.pools[i]].discard(head)
                self.heads[i] = None
                self.reserved -= head.size
                released += head.size
        return released

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
        self.high_water = max(self.high_water, block.addr + block.size)
        return block

    def hand_over(self, owner: int, new_owner: int) -> None:
        """``new_owner`` takes ``owner``'s block where it is: an op that writes its input in place."""
        block = self.by_owner.pop(owner)
        if new_owner in self.by_owner:
            raise ValueError(f"node {new_owner} already holds a block")
        block.owner = new_owner
        self.by_owner[new_owner] = block

    def free(self, owner: int) -> None:
        """Return ``owner``'s block to its pool, merged with free neighbours of its segment."""
        block = self.by_owner.pop(owner)
        self.allocated -= block.size
        block.owner = -1
        self._merge_free(block, self.free_blocks[self.pools[block.segment]])

    def _merge_free(self, block: Block, pool: set[Block]) -> Block:
        """Merge free ``block`` with its free mapped neighbours into one block of ``pool``."""
        for nb in (block.prev, block.next):
            if nb is not None and nb.usable:
                pool.discard(nb)
                lo, hi = (nb, block) if nb is block.prev else (block, nb)
                lo.size += hi.size
                lo.next = hi.next
                if hi.next is not None:
                    hi.next.prev = lo
                block = lo
        pool.add(block)
        return block

    @property
    def largest_free(self) -> int:
        return max((b.size for s in self.free_blocks.values() for b in s), default=0)

    @property
    def footprint(self) -> int:
        """Reserved bytes as this model reports them: segments (caching) or the high-water mark (arena)."""
        return self.high_water if self.policy == "arena" else self.reserved


@dataclass(frozen=True)
class FixedTensor:
    """One tensor that lives through the whole step: ``kind`` is param, grad, batch or optimizer."""

    name: str
    nbytes: int
    kind: str


def gradient_outputs(graph: Graph) -> list[tuple[int, int]]:
    """The parameter-gradient outputs of the backward pass as (node, bytes), in the model's
    parameter order (the reverse of the order backward computes them). A gradient that is a view
    (a weight's ``mm(...).t()``) has its base's bytes."""
    out = []
    for v in graph.outputs.tolist():
        if graph.phases[v] != "backward":
            continue
        base = graph.storage_of(v)
        if graph.mem[base] > 0:
            out.append((v, int(graph.mem[base])))
    return out[::-1]


def fixed_tensors(graph: Graph, optimizer: Optimizer = "adam") -> list[FixedTensor]:
    """The step's fixed tensors in allocation order: params (and buffers, constants), grads, the
    batch, then the optimizer state (one set per gradient, in parameter order). From the graph's
    optional ``fixed_tensors`` (written by ``bonsai trace``), else derived from its gradient outputs
    (see the module docstring); if those do not fit twice in ``fixed_mem`` (a graph not traced by
    this tool), ``fixed_mem`` is one batch block and there is no optimizer state."""
    if optimizer not in OPTIMIZER_STATES:
        raise ValueError(f"unknown optimizer {optimizer!r}; use one of {sorted(OPTIMIZER_STATES)}")
    if graph.optimizer is not None:  # traced with its optimizer: the state is in fixed_mem already
        return [FixedTensor(n, b, "batch" if k == "input" else k) for n, b, k in graph.fixed_tensors if b > 0]
    if graph.fixed_tensors:
        out = [FixedTensor(n, b, "batch" if k == "input" else k) for n, b, k in graph.fixed_tensors if b > 0]
        grads = [(t.name.removesuffix(".grad"), t.nbytes) for t in out if t.kind == "grad"]
    else:
        grads = [(graph.names[v], b) for v, b in gradient_outputs(graph)]
        rest = graph.fixed_mem - 2 * sum(b for _, b in grads)
        if rest < 0:
            return [FixedTensor("fixed_mem", graph.fixed_mem, "batch")] if graph.fixed_mem else []
        out = [FixedTensor(f"param of {n}", b, "param") for n, b in grads]
        out += [FixedTensor(f"grad of {n}", b, "grad") for n, b in grads]
        if rest:
            out.append(FixedTensor("batch, buffers, frozen params", rest, "batch"))
    out += [FixedTensor(f"{state} of {n}", b, "optimizer") for n, b in grads for state in OPTIMIZER_STATES[optimizer]]
    return out


def optimizer_bytes(tensors: list[FixedTensor]) -> int:
    return sum(t.nbytes for t in tensors if t.kind == "optimizer")


def state_beyond_fixed(graph: Graph, tensors: list[FixedTensor]) -> int:
    """Optimizer-state bytes of ``tensors`` that the graph's ``fixed_mem`` does not hold already (all
    of them, unless the graph was traced with its optimizer)."""
    return 0 if graph.optimizer is not None else optimizer_bytes(tensors)


def pin_fixed(alloc: Allocator, first_owner: int, tensors: list[FixedTensor],
              warmup: Callable[[Allocator], None] | None = None, updates: Updates = "inplace") -> dict[int, FixedTensor]:
    """Place the fixed tensors in ``alloc`` in a training loop's order, as owners ``first_owner``,
    ``first_owner + 1``, ...: params, grads and the batch; then the first step (``warmup``, which
    must free every block it takes; skipped when None, which is exact for the arena policy since a
    finished step leaves only merged free space); then the optimizer state, and with ``updates="copy"``
    the optimizer's writes as copy-on-write (each parameter, then each state: a new block, then the old
    one freed); then the next batch, before the first one is freed. Returns owner -> tensor of the
    blocks left in the pool. Raises BudgetError if they do not fit."""
    held: dict[int, FixedTensor] = {}
    owner = first_owner

    def take(t: FixedTensor) -> int:
        nonlocal owner
        if alloc.malloc(owner, t.nbytes) is None:
            raise BudgetError(f"The pool cannot hold the step's fixed tensors: {t.name} ({format_bytes(t.nbytes)}) "
                              f"does not fit after {format_bytes(alloc.pinned_bytes)} of them. Raise the budget.")
        held[owner] = t
        alloc.pinned_bytes += t.nbytes
        owner += 1
        return owner - 1

    batch = [t for t in tensors if t.kind == "batch"]
    for t in tensors:
        if t.kind != "optimizer":
            take(t)
    if warmup is not None:
        warmup(alloc)
    for t in tensors:
        if t.kind == "optimizer":
            take(t)

    def rewrite(t: FixedTensor) -> None:
        """``t`` written out of place: its new block is taken before the old one is freed."""
        old = next(o for o, h in held.items() if h is t)
        take(t)
        alloc.free(old)
        del held[old]
        alloc.pinned_bytes -= t.nbytes

    if updates == "copy":
        for kind in ("param", "optimizer"):
            for t in tensors:
                if t.kind == kind:
                    rewrite(t)
    elif updates != "inplace":
        raise ValueError(f"unknown updates {updates!r}; use 'inplace' or 'copy'")
    for t in batch:  # the next step's batch arrives before the last one is dropped
        rewrite(t)
    return held


@dataclass(frozen=True)
class AllocResult:
    """Per-op allocator state of a replayed schedule (all byte counts include ``fixed_mem``, and with
    ``full`` the optimizer state).

    ``live[i]``: bytes of live tensors after op i (the simulator's timeline, plus the optimizer
    state with ``full``); ``reserved[i]``: bytes
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
    full: bool = False

    def stats(self) -> dict[str, Any]:
        return {"peak": self.peak, "reserved_peak": self.reserved_peak, "fragmentation": self.fragmentation,
                "waste": self.reserved_peak - self.peak, "segments": self.segments, "allocator": self.policy,
                "full_arena": self.full}


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


def full_arena(graph: Graph, capacity: int | None, policy: Policy = "arena", optimizer: Optimizer = "adam",
               warmup: Callable[[Allocator], None] | None = None, updates: Updates = "inplace") -> tuple[Allocator, int]:
    """A pool whose fixed tensors are placed as in a training loop (:func:`pin_fixed`), and the
    optimizer-state bytes it holds beyond ``fixed_mem``. ``capacity`` is in the budget's terms
    (``fixed_mem`` included, optimizer state not); the pool gets the optimizer state on top."""
    tensors = fixed_tensors(graph, optimizer)
    extra = state_beyond_fixed(graph, tensors)
    alloc = Allocator(None if capacity is None else capacity + extra, policy)
    pin_fixed(alloc, graph.n, tensors, warmup, updates)
    return alloc, extra


def run_step(alloc: Allocator, graph: Graph, ops: list[tuple[str, int]], capacity: int | None,
             trace: tuple[np.ndarray, np.ndarray] | None = None, outside: int = 0, upto: int | None = None,
             side_of: Callable[[int], str] | None = None, inplace: bool = True,
             timing: CopyTiming = NO_COPIES) -> None:
    """Apply a schedule's ops to ``alloc`` (footprint and largest free block after each op into
    ``trace``); then the step is over and its tensors are freed. With ``upto``, stop right after op
    ``upto`` instead, leaving the pool as it is at that moment. ``side_of(v)``: the end of the
    best-fit block node v's output goes to ("left" for all when None), as an eviction run placed it.
    ``inplace``: an op written in place (simulator rule 8) takes its input's block; False: copy-on-write,
    a block of its own (a pool run with ``inplace_writes=False``). ``timing``: rule 9's clock
    (:func:`schedule.timing_of`): a free that an offload copy still reads gives its block back when the
    copy ends, and a reload takes a block as a compute does.
    On an FSDP rank, FSDP2's own buffers (:func:`bonsai_core.fsdp.buffer_events`) are allocated and freed
    before each op on their streams, and a gradient FSDP holds keeps its block past the graph's free;
    with an optimizer, its step's temporaries (:data:`bonsai_core.optimizer.STEP_TEMPORARIES`: AdamW's
    ``_foreach_sqrt``, one tensor per parameter) are allocated after the last op, then freed."""
    mem = graph.mem.tolist()
    holds = ((graph.mem > 0) & ~graph.is_view).tolist()
    written = inplace_writes(graph, ops) if inplace else {}  # rule 8: the output takes its input's block
    handed_over = set(written.values())
    fsdp = _FsdpBuffers(alloc, graph, ops, capacity, outside)

    def malloc(owner: int, nbytes: int, what: str, i: int, side: str = "left", stream: str = DEFAULT_STREAM) -> None:
        if alloc.malloc(owner, nbytes, side, stream) is None and (side == "left" or alloc.malloc(owner, nbytes, stream=stream) is None):
            raise BudgetError(
                f"The allocator runs out of its {format_bytes(capacity)} pool at op {i} ({what}, {format_bytes(nbytes)}): "
                f"{format_bytes(alloc.footprint + outside)} is in use and its largest free block is "
                f"{format_bytes(alloc.largest_free)}. Replay without a capacity to see the reserved peak this schedule needs.")

    fsdp.malloc = malloc
    for i, (kind, v) in enumerate(ops):
        fsdp.before(i)
        for pos in timing.device_released.get(i, ()):  # rule 9: the copy that read it ended
            if holds[ops[pos][1]]:
                alloc.free(ops[pos][1])
        if i in written:
            alloc.hand_over(int(graph.inplace_of[v]), v)
        elif (kind == COMPUTE or kind == RELOAD) and holds[v]:
            side = "left" if side_of is None else side_of(v)
            malloc(v, mem[v], f"computing node {v}, {graph.names[v]!r}", i, side)
        elif kind == FREE and holds[v] and i not in handed_over and i not in timing.deferred and not fsdp.keeps(v):
            alloc.free(v)
        if trace is not None:
            trace[0][i] = alloc.footprint + outside
            trace[1][i] = alloc.largest_free
        if i == upto:
            return
    fsdp.before(len(ops))  # the post-backward of the units still holding gradients
    _optimizer_step(alloc, graph, malloc, len(ops) - 1)
    if trace is not None and ops:
        trace[0][-1] = max(trace[0][-1], alloc.footprint + outside)
    for v in [o for o in alloc.by_owner if o < graph.n or o >= FSDP_OWNERS]:  # the step is over: its tensors go
        alloc.free(v)


FSDP_OWNERS = 2**50  # owner ids of FSDP2's buffers in the allocator (nodes are below graph.n, fixed tensors just above)


class _FsdpBuffers:
    """FSDP2's buffers of one replayed step, placed as :func:`bonsai_core.fsdp.buffer_events` says."""

    def __init__(self, alloc: Allocator, graph: Graph, ops: list[tuple[str, int]], capacity: int | None, outside: int) -> None:
        from bonsai_core.fsdp import buffer_events

        self.alloc, self.graph = alloc, graph
        self.events = buffer_events(graph, ops) if graph.fsdp is not None else None
        self.owners: dict[str, int] = {}
        self.made = 0  # buffers allocated so far: each gets an owner id of its own
        self.held: set[int] = set()  # gradient nodes FSDP holds
        self.dropped: set[int] = set()  # held gradients the graph has freed: their block waits for FSDP's free
        self.malloc: Callable[..., None] | None = None

    def keeps(self, v: int) -> bool:
        """Whether the graph's free of node ``v`` leaves its block to FSDP (a held gradient)."""
        if v in self.held:
            self.dropped.add(v)
            return True
        return False

    def before(self, i: int) -> None:
        if self.events is None or i >= len(self.events):
            return
        for b in self.events[i]:
            if b.key.startswith("grad:"):
                v = int(b.key[5:])
                if b.nbytes > 0:
                    self.held.add(v)
                else:
                    self.held.discard(v)
                    if v in self.dropped:
                        self.dropped.discard(v)
                        self.alloc.free(v)
            elif b.nbytes > 0:
                owner = self.owners[b.key] = FSDP_OWNERS + self.made
                self.made += 1
                self.malloc(owner, b.nbytes, f"FSDP's {b.key.partition(':')[0]}", i, stream=b.stream)
            else:
                self.alloc.free(self.owners.pop(b.key))


def _optimizer_step(alloc: Allocator, graph: Graph, malloc: Callable[..., None], i: int) -> None:
    """The optimizer step's temporaries after the last op: per trainable parameter (its gradient
    buffer's bytes), as many tensors as :data:`bonsai_core.optimizer.STEP_TEMPORARIES` says, allocated
    together (one foreach kernel), then freed."""
    from bonsai_core.optimizer import STEP_TEMPORARIES

    if graph.optimizer is None:
        return
    per_param = STEP_TEMPORARIES[graph.optimizer["name"]]
    sizes = [t[1] for t in graph.fixed_tensors if t[2] == "grad" and t[1] > 0] * per_param
    owners = [FSDP_OWNERS - 1 - k for k in range(len(sizes))]
    for owner, nbytes in zip(owners, sizes):
        malloc(owner, nbytes, "the optimizer step's temporaries", i)
    for owner in owners:
        alloc.free(owner)


@dataclass(frozen=True)
class Placed:
    """One block of the address picture: ``kind`` is a fixed tensor's kind (param, grad, batch,
    optimizer), "activation" (a node's output: evictable) or "free"; ``addr`` is relative to the
    pool's first byte (segments are laid end to end, one 512-B gap apart)."""

    addr: int
    size: int
    kind: str
    name: str
    segment: int


def layout_at(graph: Graph, schedule: Schedule | list[tuple[str, int]], op: int, capacity: int | None = None,
              policy: Policy = "caching", optimizer: Optimizer = "adam") -> list[Placed]:
    """The full arena's address space right after op ``op`` of the (steady-state) step: every
    block, in address order, with what holds it. The placement is this model's replay (best fit,
    lowest address), not a pool method's own. O(len(ops) * blocks)."""
    simulate(graph, schedule)
    ops = schedule.ops if isinstance(schedule, Schedule) else schedule
    timing = timing_of(graph, schedule)
    if not 0 <= op < len(ops):
        raise ValueError(f"op {op} is outside the schedule's {len(ops)} ops")
    if policy == "arena" and capacity is None:
        raise BudgetError("The arena allocator is one pre-reserved pool: give it a capacity (a budget).")
    tensors = fixed_tensors(graph, optimizer)
    extra = state_beyond_fixed(graph, tensors)
    alloc = Allocator(None if capacity is None else capacity + extra, policy)
    held = pin_fixed(alloc, graph.n, tensors,
                     None if policy == "arena" else (lambda a: run_step(a, graph, ops, capacity, timing=timing)))
    run_step(alloc, graph, ops, capacity, upto=op, timing=timing)
    start = 0  # the first segment's address
    out = []
    for b in alloc.blocks():
        if b.owner < 0:
            kind, name = "free", "free"
        elif b.owner >= FSDP_OWNERS:
            kind, name = "fsdp", "an FSDP buffer"
        elif b.owner >= graph.n:
            kind, name = held[b.owner].kind, held[b.owner].name
        else:
            kind, name = "activation", graph.names[b.owner]
        out.append(Placed(b.addr - start, b.size, kind, name, b.segment))
    return out


def replay(graph: Graph, schedule: Schedule | list[tuple[str, int]], capacity: int | None = None,
           policy: Policy = "caching", full: bool = True, optimizer: Optimizer = "adam",
           updates: Updates = "inplace", side_of: Callable[[int], str] | None = None,
           inplace_writes: bool = True) -> AllocResult:
    """Replay a schedule (validated by the simulator first) through the allocator model.

    ``capacity`` is the pool's size in the budget's terms (``fixed_mem`` included): with the caching
    policy no segment may take ``reserved`` past it; the arena policy needs it. ``full`` places the
    fixed tensors and the ``optimizer``'s state in the pool (the full arena; module docstring): the
    schedule runs once as the first step, the optimizer state is allocated, and the second step is
    the one measured; ``updates`` says how the optimizer wrote the fixed tensors in between (module
    docstring). ``side_of`` places each output at one end of its best-fit block (the arena's
    cheap-tensor partitioning; :func:`run_step`); ``inplace_writes=False`` gives an op written in place a
    block of its own (copy-on-write) instead of its input's. Raises BudgetError at the first request that cannot
    be served within it, and ScheduleError for an invalid schedule. O(len(ops) * blocks).
    """
    sim = simulate(graph, schedule)
    ops = schedule.ops if isinstance(schedule, Schedule) else schedule
    timing = timing_of(graph, schedule)
    fixed = graph.fixed_mem
    if capacity is not None and capacity < fixed:
        raise BudgetError(f"A pool of {format_bytes(capacity)} cannot even hold {graph.name!r}'s fixed memory "
                          f"({format_bytes(fixed)}); raise it.")
    if policy == "arena" and capacity is None:
        raise BudgetError("The arena allocator is one pre-reserved pool: give it a capacity (a budget).")
    def step(alloc: Allocator, trace: tuple[np.ndarray, np.ndarray] | None = None, outside: int = 0) -> None:
        run_step(alloc, graph, ops, capacity, trace, outside, side_of=side_of, inplace=inplace_writes, timing=timing)

    reserved = np.empty(len(ops), dtype=np.int64)
    largest = np.empty(len(ops), dtype=np.int64)
    live = sim.timeline
    if full:
        alloc, extra = full_arena(graph, capacity, policy, optimizer, warmup=None if policy == "arena" else step,
                                  updates=updates)
        live = sim.timeline + extra
        step(alloc, (reserved, largest))
    else:
        alloc = Allocator(None if capacity is None else capacity - fixed, policy)
        step(alloc, (reserved, largest), outside=fixed)
    base = live[0] if len(live) else fixed
    return AllocResult(live=live, reserved=reserved, largest_free=largest, peak=int(live.max()) if len(live) else base,
                       reserved_peak=int(reserved.max()) if len(reserved) else int(base),
                       fragmentation=fragmentation_at_peak(live, reserved), policy=policy,
                       segments=sum(h is not None for h in alloc.heads), full=full)


# -- Coop's cheap tensor partitioning: which end of a free block a tensor is placed at --------------
# (bonsai_core.solvers.coop places by it; pool_replay replays its placement)

Partition = Literal["op_type", "cost_density", "none"]
PARTITIONS = ("op_type", "cost_density", "none")
# OneFlow's high-compute-cost op types (dtr_ep_allocator.cpp, FindPiece), as aten names
EXPENSIVE_OPS = ("aten.convolution.", "aten.convolution_backward.", "aten.mm.", "aten.addmm.", "aten.bmm.",
                 "aten.baddbmm.", "aten._scaled_dot_product", "aten.add_n")


def cost_density_sides(graph: Graph) -> Callable[[int], str]:
    """Cheap tensor partitioning by cost density: 'left' for tensors of cost/byte at or below the
    median, else 'right'."""
    holds = (graph.mem > 0) & ~graph.is_view
    density = np.where(holds, graph.cost / np.maximum(graph.mem, 1), 0.0)
    median = float(np.median(density[holds])) if holds.any() else 0.0
    sides = np.where(density <= median, "left", "right")
    return lambda v: str(sides[v])


def op_type_sides(graph: Graph) -> Callable[[int], str]:
    """Cheap tensor partitioning by op type, as the reference does: outputs of conv / matmul-like
    ops (and their backward kernels) 'right', everything else 'left'."""
    sides = ["right" if op.startswith(EXPENSIVE_OPS) else "left" for op in graph.ops]
    return lambda v: sides[v]


def partition_sides(graph: Graph, partition: Partition) -> Callable[[int], str] | None:
    """The side of a free block each node's output is placed at under ``partition`` (None: off)."""
    if partition == "op_type":
        return op_type_sides(graph)
    if partition == "cost_density":
        return cost_density_sides(graph)
    return None


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
