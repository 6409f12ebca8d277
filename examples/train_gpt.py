"""A plain training loop on the zoo's GPT with bonsai's plan applied by one call.

    python examples/train_gpt.py --budget 70% --steps 5
"""

import argparse

import torch

import bonsai_core as bonsai
from bonsai_core import models


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", default="70%", help="bytes, a size (800MiB) or a share of the no-remat peak (70%%)")
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()

    torch.manual_seed(0)
    model, (tokens,), loss_fn = models.build("gpt", batch=8, seq=64, width=128, layers=4, heads=4, vocab=256)
    report = bonsai.checkpoint(model, (tokens,), loss_fn, budget=args.budget, optimizer="adamw")
    print(report)

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step in range(args.steps):
        loss = loss_fn(model(tokens))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        print(f"step {step}: loss {loss.item():.4f}")


if __name__ == "__main__":
    main()
