"""Scale-out: an exported, rematerialized model trains under FSDP2 (``fully_shard``; gloo, 2 CPU
processes) and gets the gradients one process computes for the whole batch."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from bonsai_core import models
from bonsai_core.export import export_traced, step_signature
from bonsai_core.trace import trace_model
from tests.distributed import MODEL, OPTIONS, assert_whole_batch_gradients, join_group, run_ranks, shard
from tests.test_export import recompute_before_use


def _worker(rank: int, out_dir: str, store: str, results: str) -> None:
    from torch.distributed.fsdp import fully_shard

    from bonsai_core.export import load_export

    join_group(rank, store)
    try:
        model = models.build(MODEL, seed=0, **OPTIONS)[0]
        ck = fully_shard(load_export(out_dir).load(model))  # shards model's parameters (ck holds model)
        inputs, loss_fn = shard(rank)
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
    run_ranks(_worker, out, tmp_path, "FSDP")
    assert_whole_batch_gradients(tmp_path, steps=2)  # two steps: FSDP averages the shards' gradients
