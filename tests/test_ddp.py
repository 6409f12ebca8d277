"""Scale-out: an exported, rematerialized model trains under DistributedDataParallel (gloo, 2 CPU
processes) and gets the gradients one process computes for the whole batch."""

from __future__ import annotations

import torch
import torch.distributed as dist

from bonsai_core import models
from bonsai_core.export import export_traced, step_signature
from bonsai_core.trace import trace_model
from tests.distributed import MODEL, OPTIONS, assert_whole_batch_gradients, join_group, run_ranks, shard
from tests.test_export import checkpoint_every_other


def _worker(rank: int, out_dir: str, store: str, results: str) -> None:
    from bonsai_core.export import load_export

    join_group(rank, store)
    try:
        model = models.build(MODEL, seed=0, **OPTIONS)[0]
        # the default grads="autograd" hands each gradient to autograd, where DDP's all-reduce hooks sit
        ddp = torch.nn.parallel.DistributedDataParallel(load_export(out_dir).load(model))
        inputs, loss_fn = shard(rank)
        ddp(*inputs, loss_fn=loss_fn).backward()
        torch.save({n: p.grad for n, p in model.named_parameters()}, f"{results}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_exported_model_trains_under_ddp_with_single_process_gradients(tmp_path):
    traced = trace_model(MODEL, **OPTIONS)
    out = export_traced(traced, step_signature(MODEL, OPTIONS), checkpoint_every_other(traced.graph, 0),
                        tmp_path / "export")
    run_ranks(_worker, out, tmp_path, "DDP")
    assert_whole_batch_gradients(tmp_path)  # DDP averages the shards' gradients
