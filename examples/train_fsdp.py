"""FSDP2 training with bonsai's plan: checkpoint first, then shard each decoder layer (as torchtitan applies
activation checkpointing before ``fully_shard``). Runs on CPU processes with the gloo back-end:

    torchrun --standalone --nproc-per-node 2 examples/train_fsdp.py --budget 70% --steps 3

Rank 0 plans and writes the plan cache; the other ranks wait for it and apply the cached plan, so every
rank checkpoints the same submodules. ``fsdp=world`` makes the budget one rank's: its share of the
parameters, gradients and optimizer state, and the blocks ``fully_shard`` gathers over the step.
"""

import argparse

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from transformers import LlamaConfig, LlamaForCausalLM

import bonsai_core as bonsai


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", default="70%", help="bytes, a size (2GiB) or a share of the no-remat peak per rank (70%%)")
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)  # the same initial weights on every rank; fully_shard keeps each rank's shard
    config = LlamaConfig(hidden_size=128, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=1000, max_position_embeddings=256)
    model = LlamaForCausalLM(config).train()
    torch.manual_seed(1 + rank)  # each rank its own batch
    ids = torch.randint(0, config.vocab_size, (2, 128))
    batch = {"input_ids": ids, "labels": ids}

    if rank != 0:
        dist.barrier()  # rank 0 plans first; the others then read its plan from the cache
    report = bonsai.checkpoint(model, batch, lambda out: out.loss, budget=args.budget, fsdp=world, optimizer="adamw")
    if rank == 0:
        print(report, flush=True)
        dist.barrier()

    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step in range(args.steps):
        loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses = [torch.zeros(()) for _ in range(world)]
        dist.all_gather(losses, loss.detach())
        if rank == 0:
            print(f"step {step}: loss per rank {[round(x.item(), 4) for x in losses]}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
