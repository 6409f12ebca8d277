"""Blocks and rounding: the sizes PyTorch's CUDA caching allocator rounds requests and segments to
(``c10/cuda/CUDACachingAllocator.cpp``), and :class:`Block`, a range of addresses in a segment."""

from __future__ import annotations

from bisect import bisect_left, insort
from typing import Iterator, Literal

MIN_BLOCK = 512  # kMinBlockSize: every size is rounded up to a multiple of this
SMALL_SIZE = 2**20  # kSmallSize: largest request of the small pool
SMALL_BUFFER = 2 * 2**20  # kSmallBuffer: segment size of the small pool
LARGE_BUFFER = 20 * 2**20  # kLargeBuffer: segment size for large requests below MIN_LARGE_ALLOC
MIN_LARGE_ALLOC = 10 * 2**20  # kMinLargeAlloc
ROUND_LARGE = 2 * 2**20  # kRoundLarge: larger requests reserve their size rounded up to this

DEFAULT_STREAM = "compute"  # the stream the step's ops run on (bonsai_core.fsdp.COMPUTE_STREAM)
Side = Literal["left", "right"]  # the end of a free block a request is placed at


def size_class(pool: str) -> str:
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


class FreeBlocks:
    """A pool's free blocks, grouped by size, the sizes kept in order: a best-fit request looks at the groups of
    the smallest sizes that fit instead of every free block. A block's size and address change only while it is
    out of the pool (the allocator takes it out before it splits or merges it)."""

    __slots__ = ("by_size", "sizes")

    def __init__(self) -> None:
        self.by_size: dict[int, set[Block]] = {}
        self.sizes: list[int] = []  # the sizes of by_size, ascending

    def add(self, block: Block) -> None:
        group = self.by_size.get(block.size)
        if group is None:
            self.by_size[block.size] = {block}
            insort(self.sizes, block.size)
        else:
            group.add(block)

    def discard(self, block: Block) -> None:
        group = self.by_size.get(block.size)
        if group is None or block not in group:
            return
        group.discard(block)
        if not group:
            del self.by_size[block.size]
            del self.sizes[bisect_left(self.sizes, block.size)]

    def fitting(self, size: int) -> Iterator[set[Block]]:
        """The groups of blocks of at least ``size`` bytes, smallest size first."""
        for s in self.sizes[bisect_left(self.sizes, size):]:
            yield self.by_size[s]

    @property
    def largest(self) -> int:
        return self.sizes[-1] if self.sizes else 0

    def __iter__(self) -> Iterator[Block]:
        for group in list(self.by_size.values()):
            yield from list(group)

    def __len__(self) -> int:
        return sum(len(group) for group in self.by_size.values())

    def __contains__(self, block: object) -> bool:
        return isinstance(block, Block) and block in self.by_size.get(block.size, ())
