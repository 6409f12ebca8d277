"""The harness of the scale-out tests (tests/test_ddp.py, tests/test_fsdp.py): a small GPT exported with
a rematerializing schedule trains in ``WORLD`` gloo processes, each on its own shard of the batch, and
must get the gradients one process computes for the whole batch."""

from __future__ import annotations

import time
from datetime import timedelta
from pathlib import Path
from typing import Callable

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from bonsai_core import models

MODEL, OPTIONS = "gpt", dict(batch=2, seq=16, width=32, layers=2, heads=2, vocab=64)
WORLD = 2


def shard(rank: int):
    """Rank ``rank``'s batch and targets: same shapes as the traced ones, different data."""
    _, inputs, loss_fn = models.build(MODEL, seed=100 + rank, **OPTIONS)
    return inputs, loss_fn


def join_group(rank: int, store: str) -> None:
    """Join the gloo process group of ``WORLD`` ranks through the file ``store``."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD,
                            timeout=timedelta(seconds=120))


def run_ranks(worker: Callable, out_dir: Path, tmp_path: Path, what: str, timeout: float = 300) -> None:
    """``worker(rank, out_dir, store, results)`` in ``WORLD`` processes; fails the test if they do not
    finish within ``timeout`` seconds. Spawn, not fork: forking a test process that already runs torch,
    solver and server threads can deadlock the children; a hung worker fails the test instead of
    hanging the suite."""
    ctx = mp.start_processes(worker, args=(str(out_dir), str(tmp_path / "store"), str(tmp_path)), nprocs=WORLD,
                             join=False, start_method="spawn")
    deadline = time.monotonic() + timeout
    while not ctx.join(timeout=5):
        if time.monotonic() > deadline:
            for proc in ctx.processes:
                proc.kill()
            pytest.fail(f"the {what} workers did not finish within {timeout:.0f} s")


def assert_whole_batch_gradients(results: Path, steps: int = 1) -> None:
    """Each rank's saved gradients (``results/rank{r}.pt``) equal one process's over the whole batch
    (both shards, the loss averaged over the ranks as DDP and FSDP average), accumulated over ``steps``."""
    model = models.build(MODEL, seed=0, **OPTIONS)[0]
    for _ in range(steps):
        for rank in range(WORLD):
            inputs, loss_fn = shard(rank)
            (loss_fn(model(*inputs)) / WORLD).backward()
    for rank in range(WORLD):
        grads = torch.load(results / f"rank{rank}.pt")
        for name, p in model.named_parameters():
            torch.testing.assert_close(grads[name], p.grad, atol=1e-5, rtol=0, msg=f"rank {rank}, {name}")
    assert any(float(p.grad.abs().max()) > 0 for p in model.parameters())
