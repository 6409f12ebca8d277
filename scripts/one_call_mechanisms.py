"""Mechanisms through the one call (in-place writes, frozen weights, budgets to the byte): per model (built in tests/test_one_call_models.py), the
report's predicted peak against one real CPU step (live bytes), and whether loss, gradients and
buffers equal the model's without the plan.

    PYTHONPATH=. python scripts/one_call_mechanisms.py      # writes docs/results/one_call_mechanisms.md
"""

from __future__ import annotations

import argparse
import copy
import datetime
import platform
import sys
from pathlib import Path

import torch
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import bonsai_core as bonsai  # noqa: E402
from bonsai_core.bench.common import page_header  # noqa: E402
from bonsai_core.measure import measure_step  # noqa: E402
from bonsai_core.units import format_bytes  # noqa: E402
from tests import test_one_call_models as t  # noqa: E402


def _t5():
    from transformers import T5Config, T5ForConditionalGeneration

    config = T5Config(vocab_size=256, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_decoder_layers=2, num_heads=4,
                      dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0)
    t5 = T5ForConditionalGeneration(config).train()

    class Seq2Seq(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.t5 = t5

        def forward(self, ids, labels):
            return self.t5(input_ids=ids, labels=labels)

    return Seq2Seq(), (torch.randint(0, 256, (4, 64)), torch.randint(0, 256, (4, 32))), lambda out: out.loss


def _ste():
    ids = torch.randint(0, 128, (8, 64))
    return t.BinaryLM().train(), (ids,), t.TokenLoss(ids)


CASES = [
    ("ResNet basic block: BatchNorm + ReLU(inplace=True), `out += x`", lambda: (t.Stack(t.BasicBlock).train(), (torch.randn(8, 3, 32, 32),), t._squared), "60%"),
    ("stochastic depth scaling the residual branch in place (`out.mul_(mask)`)", lambda: (t.Stack(t.ScaledResidual).train(), (torch.randn(8, 3, 32, 32),), t._squared), "60%"),
    ("timm-style DropPath (mask `div_` in place)", lambda: (t.Stack(t.DropPathResidual).train(), (torch.randn(8, 3, 32, 32),), t._squared), "60%"),
    ("attention with `scores += bias`", lambda: (nn.Sequential(*[t.BiasedLayer() for _ in range(4)]), (torch.randn(4, 64, 32),), t._squared), "60%"),
    ("transformers T5 (tiny config)", _t5, "75%"),
    ("user's STE autograd.Function, tied embedding / LM head", _ste, "60%"),
    ("transformers Llama, frozen, LoRA adapters on q/v", lambda: t._frozen_llama(True), "70%"),
    ("transformers Llama, frozen backbone, trainable head", lambda: t._frozen_llama(False, vocab=64), "90%"),
]


COMMAND = "PYTHONPATH=. python scripts/one_call_mechanisms.py"
COLUMNS = ("| model | budget | no remat: predicted | measured | with the plan: predicted | measured | error | within budget "
           "| same loss, grads, buffers |\n| --- | --- | --- | --- | --- | --- | --- | --- | --- |")


def row(name: str, make, budget: str) -> str:
    """One model through the one call at ``budget`` (``best_effort`` after a BudgetError), against one real step."""
    torch.manual_seed(0)
    model, inputs, loss_fn = make()
    reference = copy.deepcopy(model)
    plain = measure_step(copy.deepcopy(model), inputs, loss_fn).peak
    torch.manual_seed(5)
    expected = loss_fn(reference(*inputs))
    expected.backward()
    note = ""
    try:
        report = bonsai.checkpoint(model, inputs, loss_fn, budget=budget, cache=False)
    except bonsai.BudgetError:
        try:
            report = bonsai.checkpoint(model, inputs, loss_fn, budget=budget, cache=False, best_effort=True)
            note = " (best effort)"
        except bonsai.BudgetError as e:
            unplanned = bonsai.plan(model, inputs, loss_fn, budget="100%", cache=False).report.no_remat_peak
            return (f"| {name} | {budget} | {format_bytes(unplanned)} | {format_bytes(plain)} | refused: "
                    f"{str(e).split(': the smallest')[0]} | | | | |")
    torch.manual_seed(5)
    loss = loss_fn(model(*inputs))
    loss.backward()
    same = (loss.item() == expected.item()
            and all((p.grad is None and q.grad is None) or torch.equal(p.grad, q.grad)
                    for p, q in zip(model.parameters(), reference.parameters()))
            and all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), reference.state_dict().values())))
    model.zero_grad(set_to_none=True)
    measured = measure_step(model, inputs, loss_fn).peak
    predicted = report.predicted_peak
    error = f"{measured / predicted - 1:+.2%}" if predicted < 2**62 else "not predicted"
    return (f"| {name} | {budget}{note} ({format_bytes(report.budget)}) | {format_bytes(report.no_remat_peak)} "
            f"| {format_bytes(plain)} | {format_bytes(predicted) if predicted < 2**62 else '-'} | {format_bytes(measured)} "
            f"| {error} | {'yes' if measured <= report.budget else 'NO'} | {'yes' if same else 'NO'} |")


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("-o", "--out", default="docs/results/one_call_mechanisms.md")
    args = parser.parse_args(argv)
    rows = [row(*case) for case in CASES]
    text = "\n".join([
        page_header(COMMAND, ["scripts/one_call_mechanisms.py", "tests/test_one_call_models.py"]),
        "# Mechanisms through the one call",
        "",
        f"`{COMMAND}` on {datetime.date.today()}, {platform.machine()} CPU, torch {torch.__version__}: "
        "`bonsai.checkpoint(..., budget=B)` (on BudgetError, `best_effort=True`), then one real step measured "
        "(live bytes, fixed memory included); a refused row shows the no-remat prediction from `budget=\"100%\"`. "
        "How the one call handles each mechanism: [../ONE_CALL.md](../ONE_CALL.md#in-place-writes-and-what-eager-holds); "
        "the models are built in `tests/test_one_call_models.py`.",
        "",
        COLUMNS, *rows, ""])
    Path(args.out).write_text(text)
    print(text)


if __name__ == "__main__":
    main(sys.argv[1:])
