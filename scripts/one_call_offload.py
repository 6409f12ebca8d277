"""Measure bonsai.checkpoint(..., offload=True) on CPU against the same call without offload: the
configurations of tests/test_one_call_offload.py. Prints, per model and budget, the report's predicted
peak, compute overhead, offloaded tensors and bytes, host peak, and the measured device and host peaks (LiveBytes).

    PYTHONPATH=. python scripts/one_call_offload.py
"""

from __future__ import annotations

import tempfile

import torch.nn as nn

import bonsai_core as bonsai
from bonsai_core import models
from bonsai_core.measure import measure_step


class Keywords(nn.Module):
    def __init__(self, model: nn.Module, batch: dict) -> None:
        super().__init__()
        self.model, self.names = model, list(batch)

    def forward(self, *tensors):  # noqa: ANN002, ANN201
        return self.model(**dict(zip(self.names, tensors)))


def llama():
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=256, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                                      max_position_embeddings=128)
    model = transformers.LlamaForCausalLM(config).train()
    ids = torch.randint(0, config.vocab_size, (2, 64))
    return model, {"input_ids": ids, "labels": ids}


def main() -> None:
    runs = []
    gpt, inputs, loss_fn = models.build("gpt", batch=4, seq=32, width=64, layers=2, heads=2, vocab=128)
    runs.append(("zoo gpt batch=4 seq=32 width=64 layers=2", gpt, inputs, loss_fn, gpt, inputs, "90%"))
    model, batch = llama()
    runs.append(("tiny Llama 2 layers, batch 2x64", model, batch, lambda out: out.loss, Keywords(model, batch),
                 tuple(batch.values()), "90%"))
    print("| model | budget | offload | overhead | predicted peak | measured peak | error | offloaded | host peak predicted / measured |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, net, example, loss, measured_net, measured_inputs, budget in runs:
        for offload in (False, True):
            bonsai.remove_checkpoints(net)
            report = bonsai.checkpoint(net, example, loss, budget=budget, cache_dir=tempfile.mkdtemp(), offload=offload)
            m = measure_step(measured_net, measured_inputs, loss)
            print(f"| {name} | {budget} ({report.budget:,} B) | {offload} | {report.overhead:+.2%} | {report.predicted_peak:,} B | {m.peak:,} B | "
                  f"{m.peak / report.predicted_peak - 1:+.4%} | {report.offloaded} tensors, {report.offloaded_bytes:,} B"
                  f" ({report.not_offloaded} kept) | {report.host_peak:,} / {m.host_peak:,} B |")


if __name__ == "__main__":
    main()
