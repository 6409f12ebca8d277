"""Models as users bring them, each a ``bonsai trace tests.robust_models:FACTORY`` factory: built from
public library configs (no downloads) or torch.nn only, each exercising one way a model can resist
tracing or exact replay."""

import torch
import torch.nn as nn

from bonsai_core.models.zoo import CrossEntropyLoss


class LogitsLoss(CrossEntropyLoss):
    """Cross-entropy of a Hugging Face output's ``logits``."""

    def forward(self, output):
        return super().forward(output.logits)


def make_vit(batch: int = 2, image: int = 16):
    """transformers' ViT (``trunc_normal_`` in its weight initialisation), tiny."""
    from transformers import ViTConfig, ViTForImageClassification

    config = ViTConfig(image_size=image, patch_size=8, num_channels=3, hidden_size=16, num_hidden_layers=2,
                       num_attention_heads=2, intermediate_size=32, num_labels=4)
    return (ViTForImageClassification(config), (torch.randn(batch, 3, image, image),),
            LogitsLoss(torch.randint(0, 4, (batch,))))


class _TruncNormalNet(nn.Module):
    """A user's module that initialises a learned position table with ``trunc_normal_``."""

    def __init__(self, seq: int, width: int) -> None:
        super().__init__()
        self.position = nn.Parameter(torch.zeros(seq, width))
        nn.init.trunc_normal_(self.position, std=0.02)
        self.mix = nn.Linear(width, width)

    def forward(self, x):
        return self.mix(x + self.position)


def make_trunc_normal(batch: int = 2, seq: int = 4, width: int = 8):
    from bonsai_core.models.zoo import MSELoss

    return _TruncNormalNet(seq, width), (torch.randn(batch, seq, width),), MSELoss(torch.zeros(batch, seq, width))


class _LossOutput(nn.Module):
    """The loss a Hugging Face model computed itself (``labels=`` given): ``output.loss``."""

    def forward(self, output):
        return output.loss


class _Maskless(nn.Module):
    """A causal LM called as a training script calls it: ``model(input_ids=ids, labels=ids)``, no mask."""

    def __init__(self, lm: nn.Module) -> None:
        super().__init__()
        self.lm = lm

    def forward(self, ids):
        return self.lm(input_ids=ids, labels=ids)


def make_maskless_llama(batch: int = 2, seq: int = 8):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=seq, use_cache=False)
    return _Maskless(LlamaForCausalLM(config)), (torch.randint(0, 64, (batch, seq)),), _LossOutput()


class _LSTMTagger(nn.Module):
    def __init__(self, width: int, layers: int, dropout: float) -> None:
        super().__init__()
        self.lstm = nn.LSTM(width, width, num_layers=layers, dropout=dropout, batch_first=True)
        self.head = nn.Linear(width, 4)

    def forward(self, x):
        return self.head(self.lstm(x)[0]).transpose(1, 2)


def make_lstm(batch: int = 2, seq: int = 6, width: int = 8, layers: int = 2):
    """A two-layer LSTM with dropout 0.1 between its layers (inside the fused kernel)."""
    return (_LSTMTagger(width, layers, 0.1), (torch.randn(batch, seq, width),),
            CrossEntropyLoss(torch.randint(0, 4, (batch, seq))))


class _StochasticDepthBlock(nn.Module):
    """conv-BN-SiLU residual branch, dropped per sample with probability ``drop`` while training."""

    def __init__(self, width: int, drop: float) -> None:
        super().__init__()
        self.branch = nn.Sequential(nn.Conv2d(width, width, 3, padding=1, bias=False), nn.BatchNorm2d(width), nn.SiLU(),
                                    nn.Conv2d(width, width, 3, padding=1, bias=False), nn.BatchNorm2d(width))
        self.drop = drop

    def forward(self, x):
        out = self.branch(x)
        if self.training and self.drop > 0:
            keep = torch.bernoulli(torch.full((x.shape[0], 1, 1, 1), 1 - self.drop, device=x.device))
            out = out * keep / (1 - self.drop)
        return nn.functional.silu(x + out)


def make_stochastic_depth_cnn(batch: int = 4, width: int = 16, blocks: int = 4, image: int = 16):
    """A BatchNorm + SiLU CNN with stochastic depth, torch.nn only."""
    model = nn.Sequential(nn.Conv2d(3, width, 3, padding=1, bias=False), nn.BatchNorm2d(width), nn.SiLU(),
                          *(_StochasticDepthBlock(width, 0.1 * (i + 1) / blocks) for i in range(blocks)),
                          nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(width, 10))
    return model, (torch.randn(batch, 3, image, image),), CrossEntropyLoss(torch.randint(0, 10, (batch,)))


def make_maskless_gpt2(batch: int = 2, seq: int = 8):
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=64, n_positions=seq, n_embd=16, n_layer=2, n_head=2, use_cache=False)
    return _Maskless(GPT2LMHeadModel(config)), (torch.randint(0, 64, (batch, seq)),), _LossOutput()


def make_linspace_rates(batch: int = 2, width: int = 8, layers: int = 3):
    """A constructor that reads values outside ``torch.nn.init``: per-layer rates from ``torch.linspace``."""
    from bonsai_core.models.zoo import MSELoss

    rates = [x.item() for x in torch.linspace(0.0, 0.2, layers)]
    model = nn.Sequential(*(nn.Sequential(nn.Linear(width, width), nn.Dropout(r)) for r in rates))
    return model, (torch.randn(batch, width),), MSELoss(torch.zeros(batch, width))


class _ReadsInForward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mix = nn.Linear(4, 4)

    def forward(self, x):
        return self.mix(x) if x.sum() > 0 else x


def make_reads_in_forward():
    from bonsai_core.models.zoo import MSELoss

    return _ReadsInForward(), (torch.randn(2, 4),), MSELoss(torch.zeros(2, 4))
