"""Models from public libraries for the export tests (``tests.export_models:NAME`` as a MODEL):
dropout, BatchNorm, an unused parameter, Hugging Face GPT-2 (tensor constants, dropout 0.1) and
Llama (scaled-dot-product attention), all built from configs, no weights downloaded."""

from __future__ import annotations

import torch
import torch.nn as nn

from bonsai_core.models.zoo import CrossEntropyLoss


def dropout_mlp(batch: int = 16, width: int = 32) -> tuple[nn.Module, tuple[torch.Tensor, ...], nn.Module]:
    """Linear/GELU/Dropout(0.1) stack."""
    model = nn.Sequential(nn.Linear(8, width), nn.GELU(), nn.Dropout(0.1), nn.Linear(width, width), nn.GELU(),
                          nn.Dropout(0.1), nn.Linear(width, 3))
    return model, (torch.randn(batch, 8),), CrossEntropyLoss(torch.randint(0, 3, (batch,)))


def batchnorm_cnn(batch: int = 8, width: int = 4) -> tuple[nn.Module, tuple[torch.Tensor, ...], nn.Module]:
    """Conv/BatchNorm2d/ReLU twice, then a linear head."""
    model = nn.Sequential(nn.Conv2d(3, width, 3, padding=1), nn.BatchNorm2d(width), nn.ReLU(),
                          nn.Conv2d(width, width, 3, padding=1), nn.BatchNorm2d(width), nn.ReLU(),
                          nn.Flatten(), nn.Linear(width * 64, 3))
    return model, (torch.randn(batch, 3, 8, 8),), CrossEntropyLoss(torch.randint(0, 3, (batch,)))


class _WithUnusedHead(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, width), nn.Tanh(), nn.Linear(width, 3))
        self.unused = nn.Linear(width, width)  # like BERT's pooler under the MLM loss

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def unused_param(batch: int = 16, width: int = 16) -> tuple[nn.Module, tuple[torch.Tensor, ...], nn.Module]:
    return _WithUnusedHead(width), (torch.randn(batch, 8),), CrossEntropyLoss(torch.randint(0, 3, (batch,)))


class _Logits(nn.Module):
    """A Hugging Face causal LM returning its logits (the loss is the shared cross-entropy)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.lm = model

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.lm(input_ids=ids).logits


def _lm_batch(batch: int, seq: int, vocab: int) -> tuple[tuple[torch.Tensor, ...], nn.Module]:
    idx = torch.randint(0, vocab, (batch, seq + 1))
    return (idx[:, :-1].contiguous(),), CrossEntropyLoss(idx[:, 1:].contiguous(), flatten=True)


def hf_gpt2(batch: int = 2, seq: int = 16, width: int = 32, layers: int = 2, heads: int = 2, vocab: int = 64):
    """transformers' GPT2LMHeadModel with its default dropout (0.1) and SDPA attention."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_embd=width, n_layer=layers, n_head=heads, vocab_size=vocab, n_positions=seq,
                        bos_token_id=0, eos_token_id=0)
    model = _Logits(GPT2LMHeadModel(config)).train()
    return (model, *_lm_batch(batch, seq, vocab))


def hf_llama(batch: int = 2, seq: int = 16, width: int = 32, layers: int = 2, heads: int = 2, vocab: int = 64):
    """transformers' LlamaForCausalLM (no dropout; attention through the fused SDPA kernel)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=width, intermediate_size=2 * width, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=heads, vocab_size=vocab,
                         max_position_embeddings=seq, bos_token_id=0, eos_token_id=0)
    config._attn_implementation = "sdpa"
    model = _Logits(LlamaForCausalLM(config)).train()
    return (model, *_lm_batch(batch, seq, vocab))


class _InPlaceBlock(nn.Module):
    """A scaled input rectified in place (``relu_``, the largest tensor: the step's peak is there), pooled,
    then a torchvision-style basic block: Conv/BatchNorm/ReLU(inplace=True), Conv/BatchNorm, the
    residual added in place (``out += identity``) and ReLU(inplace=True) again."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, width, 1)
        self.conv1, self.bn1 = nn.Conv2d(width, width, 3, padding=1, bias=False), nn.BatchNorm2d(width)
        self.conv2, self.bn2 = nn.Conv2d(width, width, 3, padding=1, bias=False), nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=True)
        self.head = nn.Linear(width, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x * 2.0
        y.relu_()
        identity = self.stem(nn.functional.avg_pool2d(y, 4))
        out = self.relu(self.bn1(self.conv1(identity)))
        out = self.bn2(self.conv2(out))
        out += identity
        out = self.relu(out)
        return self.head(out.mean((2, 3)))


def inplace_block(batch: int = 8, image: int = 32, width: int = 4) -> tuple[nn.Module, tuple[torch.Tensor, ...], nn.Module]:
    """:class:`_InPlaceBlock`: in-place writes (``relu_``, ``+=``) that eager and the replay export both run."""
    torch.manual_seed(0)
    model = _InPlaceBlock(width).train()
    return model, (torch.randn(batch, 3, image, image),), CrossEntropyLoss(torch.randint(0, 3, (batch,)))
