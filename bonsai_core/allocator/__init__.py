"""An address-level allocator model: replay a schedule block by block, as a GPU allocator would.

The simulator counts live bytes, as if memory were a commodity. It is not: a freed block sits at an
address, and a request can only be served by one free block that is large enough. This module
models that, so that every method's schedule can be judged by the bytes an allocator must *reserve*
for it, not only by the bytes its tensors hold.

Three policies share one block structure (address-ordered blocks inside segments, split on
allocation, merged with free neighbours on free, never merged across segments), each a class behind
one interface (:mod:`~bonsai_core.allocator.policies`):

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

The parts: :mod:`~bonsai_core.allocator.blocks` (blocks and rounding),
:mod:`~bonsai_core.allocator.policies` (the allocator state and the three policies),
:mod:`~bonsai_core.allocator.fixed` (fixed-memory placement, the full arena),
:mod:`~bonsai_core.allocator.replaying` (a schedule replayed, its address picture) and
:mod:`~bonsai_core.allocator.pipelined` (a pipeline rank's whole step: every microbatch's actions in its
schedule's order). Coop's cheap-tensor
partitioning is the method's (:mod:`bonsai_core.solvers.coop`), and the replay of a pool method's own
pool is :func:`bonsai_core.solvers.pool.pool_replay`.
"""

from bonsai_core.allocator.blocks import (DEFAULT_STREAM, LARGE_BUFFER, MIN_BLOCK, MIN_LARGE_ALLOC, ROUND_LARGE,
                                          SMALL_BUFFER, SMALL_SIZE, Block, Side, round_size, segment_size)
from bonsai_core.allocator.fixed import (OPTIMIZER_STATES, FixedTensor, Optimizer, Updates, fixed_tensors,
                                         full_arena, gradient_outputs, optimizer_bytes, pin_fixed, state_beyond_fixed)
from bonsai_core.allocator.policies import (PAGE, POLICIES, VIRTUAL, Allocator, ArenaAllocator, CachingAllocator,
                                            ExpandableAllocator, Policy)
from bonsai_core.allocator.replaying import (FSDP_OWNERS, AllocResult, Placed, bounded_replay, fragmentation_at_peak,
                                             layout_at, replay, replay_as_solved, run_step, solved_within)

__all__ = ["DEFAULT_STREAM", "FSDP_OWNERS", "LARGE_BUFFER", "MIN_BLOCK", "MIN_LARGE_ALLOC", "OPTIMIZER_STATES", "PAGE",
           "POLICIES", "ROUND_LARGE", "SMALL_BUFFER", "SMALL_SIZE", "VIRTUAL", "AllocResult", "Allocator",
           "ArenaAllocator", "Block", "CachingAllocator", "ExpandableAllocator", "FixedTensor", "Optimizer", "Placed",
           "Policy", "Side", "Updates", "bounded_replay", "fixed_tensors", "fragmentation_at_peak", "full_arena", "gradient_outputs",
           "layout_at", "optimizer_bytes", "pin_fixed", "replay", "replay_as_solved", "round_size", "run_step",
           "segment_size", "solved_within", "state_beyond_fixed"]
