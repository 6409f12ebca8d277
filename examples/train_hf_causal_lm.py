"""A Hugging Face causal LM built from its config (no weights downloaded), trained with bonsai's plan.

    python examples/train_hf_causal_lm.py --budget 60% --steps 3
"""

import argparse

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import bonsai_core as bonsai


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", default="60%", help="bytes, a size (2GiB) or a share of the no-remat peak (60%%)")
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=128, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=1000, max_position_embeddings=256)
    model = LlamaForCausalLM(config).train()
    ids = torch.randint(0, config.vocab_size, (4, 128))
    batch = {"input_ids": ids, "labels": ids}  # called as training scripts call it: no attention mask

    report = bonsai.checkpoint(model, batch, lambda out: out.loss, budget=args.budget, optimizer="adamw")
    print(report)

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step in range(args.steps):
        loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        print(f"step {step}: loss {loss.item():.4f}")


if __name__ == "__main__":
    main()
