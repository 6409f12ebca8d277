"""A budget is a promise (issue 55): ``bonsai.checkpoint`` returns a plan whose measured peak is within the
budget, or raises BudgetError naming a budget it then meets. At 60%, 70%, 80% and 90% of the no-remat
peak, on DeBERTa (v1 with dropout, v2 with relative attention) built from tiny configs, the tiny Llama of
docs/ONE_CALL.md and the models of the one-call tests; each measured over two steady steps."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import bonsai_core as bonsai
from bonsai_core.measure import measure_step

BUDGETS = ("60%", "70%", "80%", "90%")


class Labelled(nn.Module):
    """A transformers model trained on its own labels: ``model(input_ids=ids, labels=ids)``."""

    def __init__(self, lm: nn.Module) -> None:
        super().__init__()
        self.lm = lm

    def forward(self, ids: torch.Tensor):
        return self.lm(input_ids=ids, labels=ids)


def _labelled(lm: nn.Module, vocab: int, batch: int, seq: int):
    return Labelled(lm.train()), (torch.randint(0, vocab, (batch, seq)),), lambda out: out.loss


def deberta():
    from transformers import DebertaConfig, DebertaForMaskedLM

    torch.manual_seed(0)
    config = DebertaConfig(vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                           intermediate_size=256, max_position_embeddings=128)
    return _labelled(DebertaForMaskedLM(config), 512, 4, 64)


def deberta_v2():
    from transformers import DebertaV2Config, DebertaV2ForMaskedLM

    torch.manual_seed(0)
    config = DebertaV2Config(vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                             intermediate_size=256, max_position_embeddings=128, relative_attention=True,
                             pos_att_type=["p2c", "c2p"], position_buckets=32, max_relative_positions=64)
    return _labelled(DebertaV2ForMaskedLM(config), 512, 2, 64)


def tiny_llama():
    """docs/ONE_CALL.md's (scripts/one_call_offload.py): 2 layers, batch 2 x 64."""
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=256, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                                      max_position_embeddings=128)
    return _labelled(transformers.LlamaForCausalLM(config), 256, 2, 64)


def one_call_models():
    """The models of tests/test_one_call_models.py, tests/test_ctc.py and tests/test_fused_kernels.py."""
    from tests import test_ctc
    from tests import test_one_call_models as one

    def stack(block):
        torch.manual_seed(0)
        return one.Stack(block).train(), (torch.randn(8, 3, 32, 32),), one._squared

    def biased():
        torch.manual_seed(0)
        return nn.Sequential(*[one.BiasedLayer() for _ in range(4)]), (torch.randn(4, 64, 32),), one._squared

    def binary():
        torch.manual_seed(0)
        ids = torch.randint(0, 128, (8, 64))
        return one.BinaryLM().train(), (ids,), one.TokenLoss(ids)

    def recurrent():
        from tests.recurrent_models import make_recurrent_lm

        torch.manual_seed(0)
        return make_recurrent_lm("lstm", dropout=0.1)

    return {"resnet-basic-block": lambda: stack(one.BasicBlock), "stochastic-depth": lambda: stack(one.ScaledResidual),
            "timm-drop-path": lambda: stack(one.DropPathResidual), "biased-attention": biased, "binary-lm": binary,
            "lora-llama": lambda: one._frozen_llama(True), "frozen-llama": lambda: one._frozen_llama(False, vocab=64),
            "gpt2-dropout": one._tiny_gpt2_with_dropout, "ctc": test_ctc.make_ctc, "lstm-lm": recurrent}


MODELS = {"deberta": deberta, "deberta-v2": deberta_v2, "tiny-llama": tiny_llama,
          **{name: factory for name, factory in one_call_models().items()}}


def _kept(model: nn.Module, inputs: tuple, loss_fn, budget: str | int) -> tuple[int, list[int]]:
    """(the budget bonsai.checkpoint met, two measured steps' peaks): at ``budget``, or, where it raises
    BudgetError, at the budget the error names."""
    try:
        report = bonsai.checkpoint(model, inputs, loss_fn, budget=budget, cache=False)
    except bonsai.BudgetError as e:
        assert e.smallest is not None and f"Give budget={e.smallest} " in str(e), str(e)
        report = bonsai.checkpoint(model, inputs, loss_fn, budget=e.smallest, cache=False)
        assert report.budget == e.smallest
    assert report.predicted_peak <= report.budget, str(report)
    return report.budget, [measure_step(model, inputs, loss_fn).peak for _ in range(2)]


@pytest.mark.slow
@pytest.mark.parametrize("name", MODELS)
def test_a_budget_is_met_or_refused_with_one_that_is(name):
    if name.startswith(("deberta", "tiny-llama", "lora", "frozen", "gpt2")):
        pytest.importorskip("transformers")
    model, inputs, loss_fn = MODELS[name]()
    for budget in BUDGETS:
        met, peaks = _kept(copy.deepcopy(model), inputs, loss_fn, budget)
        assert max(peaks) <= met, (name, budget, met, peaks)
