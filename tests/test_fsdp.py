"""Scale-out: an exported, rematerialized model trains under FSDP2 (``fully_shard``; gloo, 2 CPU
processes) and gets the gradients one process computes for the whole batch."""

from __future__ import annotations

import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from bonsai_core import models
from bonsai_core.export import export_traced, step_signature
from bonsai_core.trace import trace_model
from tests.test_export import recompute_before_use

MODEL, OPTIONS = "gpt", dict(batch=2, seq=16, width=32, layers=2, heads=2, vocab=64)
WORLD = 2


def _shard(rank: int):
    """Rank ``rank``'s batch and targets: same shapes as the traced ones, different data."""
    _, inputs, loss_fn = models.build(MODEL, seed=100 + rank, **OPTIONS)
    return inputs, loss_fn


def _worker(rank: int, out_dir: str, store: str, results: str) -> None:
    from torch.distributed.fsdp import fully_shard

    from bonsai_core.export import load_export

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD,
                            timeout=timedelta(seconds=120))
    try:
        model = models.build(MODEL, seed=0, **OPTIONS)[0]
        ck = fully_shard(load_export(out_dir).load(model))  # shards model's parameters (ck holds model)
        inputs, loss_fn = _shard(rank)
        for step in range(2):  # the second step runs from sharded .grad already allocated
            ck(*inputs, loss_fn=loss_fn).backward()
        torch.save({n: p.grad.full_tensor() for n, p in model.named_parameters()}, f"{results}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.slow  # ~100 s on the shared 2-core machine (process spawn, tracing)
def test_exported_model_trains_under_fsdp_with_single_process_gradients(tmp_path):
    traced = trace_model(MODEL, **OPTIONS)
    out = export_traced(traced, step_signature(MODEL, OPTIONS), recompute_before_use(traced.graph, 1),
                        tmp_path / "export")
    ctx = mp.start_processes(_worker, args=(str(out), str(tmp_path / "store"), str(tmp_path)), nprocs=WORLD,
                             join=False, start_method="spawn")
    deadline = time.monotonic() + 300
    while not ctx.join(timeout=5):
        if time.monotonic() > deadline:
            for proc in ctx.processes:
                proc.kill()
            pytest.fail("the FSDP workers did not finish within 300 s")

    # one process, whole batch (both shards), two steps: FSDP averages the shards' gradients
    model = models.build(MODEL, seed=0, **OPTIONS)[0]
    for _ in range(2):
        for rank in range(WORLD):
            inputs, loss_fn = _shard(rank)
            (loss_fn(model(*inputs)) / WORLD).backward()
    for rank in range(WORLD):
        grads = torch.load(tmp_path / f"rank{rank}.pt")
        for name, p in model.named_parameters():
            torch.testing.assert_close(grads[name], p.grad, atol=1e-5, rtol=0, msg=f"rank {rank}, {name}")
    assert any(float(p.grad.abs().max()) > 0 for p in model.parameters())
