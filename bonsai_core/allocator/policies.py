"""The allocator state and its three policies, one class each behind :class:`Allocator`'s interface.

:class:`Allocator` holds what every policy shares: segments of address-ordered blocks, split on
allocation and merged with free neighbours on free (never across segments), free blocks per pool.
A policy says which pool serves a request (:meth:`Allocator.pool_of`), which free block it takes
(:meth:`~Allocator.find_block`), when the rest of a block is split off (:meth:`~Allocator.should_split`),
how the pool grows when nothing fits (:meth:`~Allocator.grow`), what it gives back on a miss
(:meth:`~Allocator.release_cached`) and what it reports as reserved (:attr:`~Allocator.footprint`).
``Allocator(capacity, policy)`` makes the policy's class: :class:`CachingAllocator`,
:class:`ExpandableAllocator` or :class:`ArenaAllocator` (the package docstring has their rules).
"""

from __future__ import annotations

import copy
from collections import defaultdict
from typing import Any, ClassVar, Iterator, Literal

from bonsai_core.allocator.blocks import (DEFAULT_STREAM, LARGE_BUFFER, MIN_BLOCK, SMALL_BUFFER, SMALL_SIZE, Block,
                                          FreeBlocks, Side, round_size, segment_size, size_class)

Policy = Literal["caching", "arena", "expandable"]
POLICIES = ("caching", "arena", "expandable")
# ExpandableSegment's page size per pool (kSmallBuffer, kLargeBuffer), and the virtual size of a pool's
# one segment in this model: larger than any device, a multiple of both pages.
PAGE = {"small": SMALL_BUFFER, "large": LARGE_BUFFER}
VIRTUAL = LARGE_BUFFER * 2**22

_CLASSES: dict[str, type["Allocator"]] = {}  # policy name -> its class


def _address(block: Block) -> int:
    return block.addr


class Allocator:
    """A mutable allocator state: segments of address-ordered blocks.

    ``capacity`` bounds the bytes reserved for tensors (the caller subtracts ``fixed_mem``); None is
    unbounded (not for the arena). ``Allocator(capacity, policy)`` returns an instance of the policy's
    class. Every operation is O(number of blocks), which is at most a few thousand for the graphs of
    this tool.
    """

    policy: ClassVar[str]
    SEGMENT_GAP: ClassVar[int] = MIN_BLOCK  # bytes between two segments: they are never contiguous

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        _CLASSES[cls.policy] = cls

    def __new__(cls, capacity: int | None = None, policy: Policy = "caching") -> "Allocator":
        if cls is Allocator:
            if policy not in _CLASSES:
                raise ValueError(f"unknown allocator policy {policy!r}; use one of {', '.join(POLICIES)}")
            cls = _CLASSES[policy]
        return super().__new__(cls)

    def __init__(self, capacity: int | None = None, policy: Policy | None = None) -> None:
        if policy is not None and policy != self.policy:
            raise ValueError(f"a {type(self).__name__} has the {self.policy!r} policy, not {policy!r}")
        self.capacity = capacity
        self.heads: list[Block | None] = []  # first block of each segment (None once released)
        self.pools: list[str] = []  # pool of each segment
        # free blocks per pool; a pool is a size class on one stream ("large", "large@reduce_scatter"): the
        # caching allocator keeps blocks per stream and serves a request only from its stream's blocks
        self.free_blocks: dict[str, FreeBlocks] = defaultdict(FreeBlocks)
        self.by_owner: dict[int, Block] = {}
        self.reserved = 0
        self.allocated = 0  # bytes of blocks held by owners (rounded sizes, whole unsplit blocks)
        self.high_water = 0  # highest address end ever held, relative to the first segment
        self.pinned_bytes = 0  # bytes of fixed tensors placed in the pool (the full arena), else 0
        self.pinned: dict[int, Any] = {}  # owner -> the fixed tensor it is (fixed.FixedTensor), placed by pin_fixed
        self._next_addr = 0

    def clone(self) -> "Allocator":
        """An independent copy: every block copied, linked, owned and pooled as it is."""
        new = copy.copy(self)
        copies: dict[int, Block] = {}

        def copied(b: Block) -> Block:
            if id(b) not in copies:
                c = copies[id(b)] = Block(b.addr, b.size, b.segment, b.mapped)
                c.owner = b.owner
            return copies[id(b)]

        new.heads = []
        for head in self.heads:
            b, prev = head, None
            while b is not None:
                c = copied(b)
                c.prev = prev
                if prev is not None:
                    prev.next = c
                prev, b = c, b.next
            new.heads.append(None if head is None else copies[id(head)])
        new.pools = list(self.pools)
        new.free_blocks = defaultdict(FreeBlocks)
        for pool, blocks in self.free_blocks.items():
            for b in blocks:
                new.free_blocks[pool].add(copied(b))
        new.by_owner = {owner: copied(b) for owner, b in self.by_owner.items()}
        new.pinned = dict(self.pinned)
        if isinstance(getattr(self, "expandable", None), dict):
            new.expandable = dict(self.expandable)
        return new

    # -- what a policy decides -----------------------------------------------------------------

    def pool_of(self, size: int, stream: str = DEFAULT_STREAM) -> str:
        """The pool a request is served from: its size class, on its stream (``get_pool`` and the
        ``BlockPool``'s (stream, size) order in ``c10/cuda/CUDACachingAllocator.cpp``)."""
        size_class_ = "small" if size <= SMALL_SIZE else "large"
        return size_class_ if stream == DEFAULT_STREAM else f"{size_class_}@{stream}"

    def find_block(self, size: int, side: Side = "left", stream: str = DEFAULT_STREAM) -> Block | None:
        """Best fit among the cached free blocks of the request's pool (on its stream); on ties, the
        lowest address (``side="left"``) or the highest (``"right"``)."""
        for group in self.free_blocks[self.pool_of(size, stream)].fitting(size):
            return (min if side == "left" else max)(group, key=_address)
        return None

    def should_split(self, pool: str, remaining: int) -> bool:
        """Whether a block taken with ``remaining`` bytes to spare is split, the rest staying free."""
        return remaining >= MIN_BLOCK

    def grow(self, pool: str, size: int) -> Block | None:
        """A new free block of at least ``size`` bytes in ``pool`` when no cached one fits, within the
        capacity; None when the capacity does not allow one."""
        return None

    def release_cached(self) -> int:
        """PyTorch's release-and-retry on OOM: give back what the policy can of the memory no tensor
        holds; returns the bytes released."""
        return 0

    @property
    def footprint(self) -> int:
        """Reserved bytes as this model reports them."""
        return self.reserved

    # -- segments ------------------------------------------------------------------------------

    def _add_segment(self, size: int, pool: str, mapped: bool = True) -> Block:
        block = Block(self._next_addr, size, len(self.heads), mapped)
        self._next_addr += size + self.SEGMENT_GAP
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

    # -- allocation ----------------------------------------------------------------------------

    def malloc(self, owner: int, nbytes: int, side: Side = "left", stream: str = DEFAULT_STREAM) -> Block | None:
        """Give ``owner`` a block of ``nbytes`` (rounded) from ``stream``'s pools; None when nothing fits
        and the pool cannot grow within the capacity, even after :meth:`release_cached` (the caller then
        evicts, or it is out of memory)."""
        if owner in self.by_owner:
            raise ValueError(f"node {owner} already holds a block")
        size = round_size(nbytes)
        block = self.find_block(size, side, stream)
        if block is None:
            pool = self.pool_of(size, stream)
            block = self.grow(pool, size)
            if block is None:
                self.release_cached()
                block = self.grow(pool, size)
                if block is None:
                    return None
        return self._take(block, size, owner, side)

    def _take(self, block: Block, size: int, owner: int, side: Side) -> Block:
        pool = self.pools[block.segment]
        self.free_blocks[pool].discard(block)
        remaining = block.size - size
        if self.should_split(pool, remaining):
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

    def _merge_free(self, block: Block, pool: FreeBlocks) -> Block:
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
        """The largest free block (a replay asks after every op: each pool keeps its sizes in order)."""
        return max((blocks.largest for blocks in self.free_blocks.values()), default=0)


class CachingAllocator(Allocator):
    """PyTorch's CUDA caching allocator with its default settings: a new segment per miss (2 MiB,
    20 MiB, or the request rounded up to 2 MiB), large blocks split only when more than 1 MiB remains,
    and on a capacity miss every segment that holds no tensor released."""

    policy = "caching"

    def should_split(self, pool: str, remaining: int) -> bool:
        if size_class(pool) == "large":
            return remaining > SMALL_SIZE
        return remaining >= MIN_BLOCK

    def can_grow(self, size: int) -> bool:
        """Whether a new segment for a rounded request ``size`` fits the capacity."""
        return self.capacity is None or self.reserved + segment_size(size) <= self.capacity

    def grow(self, pool: str, size: int) -> Block | None:
        return self._add_segment(segment_size(size), pool) if self.can_grow(size) else None

    def release_cached(self) -> int:
        """Every cached segment that holds no tensor goes (``release_cached_blocks``, as ``empty_cache``
        does)."""
        released = 0
        for i, head in enumerate(self.heads):
            if head is not None and head.free and head.next is None:
                self.free_blocks[self.pools[i]].discard(head)
                self.heads[i] = None
                self.reserved -= head.size
                released += head.size
        return released


class ArenaAllocator(Allocator):
    """OneFlow's DTR allocator's one pre-reserved pool (Coop's): a single segment of ``capacity``
    bytes, blocks always split, never grown nor released; it reports the high-water mark of the
    addresses used."""

    policy = "arena"

    def __init__(self, capacity: int | None = None, policy: Policy | None = None) -> None:
        if capacity is None:
            raise ValueError("the arena policy needs a capacity")
        super().__init__(capacity, policy)
        arena = (capacity // MIN_BLOCK) * MIN_BLOCK
        if arena > 0:
            self._add_segment(arena, "arena")

    def pool_of(self, size: int, stream: str = DEFAULT_STREAM) -> str:
        return "arena"

    @property
    def footprint(self) -> int:
        """The high-water mark of the addresses used: the whole arena is reserved up front."""
        return self.high_water


class ExpandableAllocator(Allocator):
    """The caching allocator with ``expandable_segments:True``: each pool one segment of virtual
    address space, mapped page by page (``ExpandableSegment``); on a capacity miss the pages wholly
    inside free blocks are unmapped."""

    policy = "expandable"
    SEGMENT_GAP = LARGE_BUFFER  # a page, keeping pages aligned

    def __init__(self, capacity: int | None = None, policy: Policy | None = None) -> None:
        super().__init__(capacity, policy)
        self.expandable: dict[str, int] = {}  # pool -> its one segment (one per stream too)

    def find_block(self, size: int, side: Side = "left", stream: str = DEFAULT_STREAM) -> Block | None:
        """``get_free_block`` with expandable segments: the smallest mapped free block that fits,
        except that a block bordering unmapped space counts as the size it could grow to, so the
        walk up the size order moves past it to a block that can grow less."""
        def growable(b: Block) -> int:
            return b.size + (b.next.size if b.next is not None and not b.next.mapped else 0)

        groups = self.free_blocks[self.pool_of(size, stream)].fitting(size)
        smallest = next(groups, None)
        if smallest is None:
            return None
        best = min(smallest, key=_address)  # the first in (size, address) order
        if growable(best) == best.size:
            return best  # every other block that fits can grow to at least its size: the walk stops at it
        fits = sorted(smallest, key=_address) + [b for group in groups for b in sorted(group, key=_address)]
        i = 0
        while i + 1 < len(fits) and growable(fits[i + 1]) < growable(fits[i]):
            i += 1
        return fits[i]

    def grow(self, pool: str, size: int) -> Block | None:
        """``try_allocate_expandable_block``: map the pages a request lacks, within the capacity."""
        start = self._expandable_run(pool, size)
        if self.capacity is not None and self.reserved + self._pages_to_map(start, size) > self.capacity:
            return None
        page, block = PAGE[size_class(pool)], start
        while True:
            if not block.mapped:
                block = self._map(block, min(block.size, page * -(-size // page)))
            if block.size >= size:
                return block
            assert block.next is not None and not block.next.mapped
            lacking = size - block.size
            block = self._map(block.next, min(block.next.size, page * -(-lacking // page)))

    def release_cached(self) -> int:
        """``unmap_block`` on every free mapped block: the pages wholly inside it are unmapped."""
        released = 0
        for pool, segment in self.expandable.items():
            page, base = PAGE[size_class(pool)], self.heads[segment].addr
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
        page, need, b, covered = PAGE[size_class(self.pools[start.segment])], 0, start, 0
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
