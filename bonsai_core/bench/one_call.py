"""``bonsai_core.checkpoint`` on models built from public libraries: the report's predicted peak against
the peak measured on one real training step (CPU, live bytes), whether loss, gradients and buffers
equal the model's without the plan (one seed), and how long the first and the cached call take.
``--page docs/bench/one_call.md`` writes the page from ``--out``/results.json (``--report-only``: no run).
"""

from __future__ import annotations

import argparse
import copy
import tempfile
import time
from pathlib import Path
from typing import Any

from bonsai_core.bench import common
from bonsai_core.errors import BudgetError


def _hf(model: str, config: str, **options: Any) -> Any:
    """``transformers.MODEL(transformers.CONFIG(**options))``, its weights initialised as transformers does."""
    import transformers

    return getattr(transformers, model)(getattr(transformers, config)(**options))


def llama(batch: int = 4, seq: int = 256):
    lm = _hf("LlamaForCausalLM", "LlamaConfig", hidden_size=256, intermediate_size=1024, num_hidden_layers=6,
             num_attention_heads=8, num_key_value_heads=4, vocab_size=4096, max_position_embeddings=seq)
    return _maskless(lm, batch, seq, lm.config.vocab_size)


def gpt2(batch: int = 4, seq: int = 256, dropout: float = 0.1):
    lm = _hf("GPT2LMHeadModel", "GPT2Config", n_embd=256, n_layer=6, n_head=8, vocab_size=4096, n_positions=seq,
             resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout)
    return _maskless(lm, batch, seq, lm.config.vocab_size)


def from_tests(make: str, **options: int):
    """A model of the checkout's tests/robust_models.py, ``make(**options)``."""
    common.import_test_models()
    from tests import robust_models

    return getattr(robust_models, make)(**options)


def _classifier(model: Any, batch: int, image: int):
    """An image classifier called with its labels, as its training loop calls it; the loss is its own."""
    import torch

    class WithLabels(torch.nn.Module):
        def __init__(self, model: torch.nn.Module, labels: torch.Tensor) -> None:
            super().__init__()
            self.model = model
            self.register_buffer("labels", labels)

        def forward(self, pixels: torch.Tensor):
            return self.model(pixel_values=pixels, labels=self.labels)

    labels = torch.randint(0, model.config.num_labels, (batch,))
    return WithLabels(model.train(), labels), (torch.randn(batch, 3, image, image),), lambda out: out.loss


def _maskless(lm: Any, batch: int, seq: int, vocab: int):
    """The language model called as training scripts call it: no attention mask, the ids as labels."""
    import torch

    class Maskless(torch.nn.Module):
        def __init__(self, lm: torch.nn.Module) -> None:
            super().__init__()
            self.lm = lm

        def forward(self, ids: torch.Tensor):
            return self.lm(input_ids=ids, labels=ids)

    return Maskless(lm.train()), (torch.randint(0, vocab, (batch, seq)),), lambda out: out.loss


MODELS = {"transformers Llama (6 layers, 256 wide, seq 256, SDPA)": llama,
          "transformers GPT-2 (6 layers, 256 wide, seq 256, SDPA, no dropout)": lambda: gpt2(dropout=0.0),
          "transformers GPT-2 (6 layers, 256 wide, seq 256, SDPA, dropout 0.1)": gpt2,
          "transformers ViT (trunc_normal_ init, 64 px, batch 32)": lambda: from_tests("make_vit", batch=32, image=64),
          "BatchNorm + SiLU CNN, stochastic depth (torch.nn)": lambda: from_tests(
              "make_stochastic_depth_cnn", batch=16, width=32, blocks=6, image=32),
          "transformers RegNet-Y (BatchNorm, 22 residual `+=` in place, 112 px, batch 16)": lambda: _classifier(
              _hf("RegNetForImageClassification", "RegNetConfig", num_labels=10), batch=16, image=112),
          "transformers EfficientNet-B0 (BatchNorm, SiLU, dropout, drop-connect, 112 px, batch 16)":
              lambda: _classifier(_hf("EfficientNetForImageClassification", "EfficientNetConfig", width_coefficient=1.0,
                                      depth_coefficient=1.0, image_size=112, hidden_dim=1280, dropout_rate=0.2,
                                      drop_connect_rate=0.2, num_labels=10), batch=16, image=112)}


def one(make, budget: str, cache: Path) -> dict:
    import torch

    import bonsai_core as bonsai
    from bonsai_core.measure import measure_step

    torch.manual_seed(0)
    model, inputs, loss_fn = make()
    reference = copy.deepcopy(model)
    # the cached call plans a copy in the first call's state, as a second run of the script would: a
    # step changes what the key reads (transformers' classifiers set config.problem_type on their first
    # forward), and a changed key is planned again
    again = copy.deepcopy(model)
    torch.manual_seed(5)
    expected = loss_fn(reference(*inputs))
    expected.backward()

    start = time.perf_counter()
    report = bonsai.checkpoint(model, inputs, loss_fn, budget=budget, cache_dir=cache)
    first = time.perf_counter() - start
    start = time.perf_counter()
    bonsai.checkpoint(again, inputs, loss_fn, budget=budget, cache_dir=cache)
    cached = time.perf_counter() - start

    torch.manual_seed(5)
    loss = loss_fn(model(*inputs))
    loss.backward()
    same = (loss.item() == expected.item()
            and all(torch.equal(p.grad, q.grad) for p, q in zip(model.parameters(), reference.parameters()))
            and all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), reference.state_dict().values())))
    model.zero_grad(set_to_none=True)
    measured = measure_step(model, inputs, loss_fn).peak
    reference.zero_grad(set_to_none=True)
    measured_no_remat = measure_step(reference, inputs, loss_fn).peak
    return {"regions": len(report.regions), "no_remat": report.no_remat_peak, "measured_no_remat": measured_no_remat,
            "predicted": report.predicted_peak, "measured": measured, "error": measured / report.predicted_peak - 1,
            "overhead": report.overhead, "same": same, "first": first, "cached": cached}


OUT = "docs/bench/one_call"
PAGE = "docs/bench/one_call.md"
SOURCES = ["bonsai_core/bench/one_call.py", common.template_source("one_call")]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The suite's options."""
    parser.add_argument("--budget", default="70%")
    common.add_page_arguments(parser, OUT, PAGE)


def measure(budget: str) -> dict[str, Any]:
    """One row per model, printed as measured; a budget the call refuses is the row's words."""
    rows = []
    with tempfile.TemporaryDirectory() as cache:
        for name, make in MODELS.items():
            try:
                rows.append({"model": name, **one(make, budget, Path(cache))})
            except BudgetError as e:  # the call refuses a budget its checkpoints cannot meet: a row, not the end
                rows.append({"model": name, "refused": str(e)})
            print(rows[-1], flush=True)
    return {"meta": common.run_meta(budget=budget), "rows": rows}


page = common.filled("one_call")


def main(args: argparse.Namespace) -> int:
    return common.run_page_suite("one-call", args, common.page_refusal(args, OUT, PAGE), lambda: measure(args.budget),
                                 common.page_writer(page, SOURCES))
