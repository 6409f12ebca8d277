"""Models as users bring them, each a ``package.module:factory`` (``bonsai trace tests.real_models:resnet18_bn``):
small torch.nn CNNs with BatchNorm, a MobileNetV3-style block stack (hardswish, squeeze-excite), a ViT
that checks shapes with ``torch._assert``, and Hugging Face GPT-2 / BERT built from configs (no weights).

Each factory returns ``(model, example_inputs, loss_fn)`` in train mode, deterministic under a seed."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from bonsai_core.models.zoo import CrossEntropyLoss


# -- ResNet-18 with BatchNorm ----------------------------------------------------------------------

class BasicBlock(nn.Module):
    def __init__(self, c_in: int, c_out: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.down = None
        if stride != 1 or c_in != c_out:
            self.down = nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride, bias=False), nn.BatchNorm2d(c_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)), inplace=True)
        out = self.bn2(self.conv2(out))
        return F.relu(out + (x if self.down is None else self.down(x)), inplace=True)


class ResNet18(nn.Module):
    """torchvision's ResNet-18 layout (7x7 stem, max-pool, 4 stages of 2 basic blocks)."""

    def __init__(self, width: int = 64, classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 7, 2, 3, bias=False), nn.BatchNorm2d(width),
                                  nn.ReLU(inplace=True), nn.MaxPool2d(3, 2, 1))
        blocks, c = [], width
        for stage in range(4):
            c_out = width * 2**stage
            blocks += [BasicBlock(c, c_out, 1 if stage == 0 else 2), BasicBlock(c_out, c_out, 1)]
            c = c_out
        self.blocks = nn.Sequential(*blocks)
        self.fc = nn.Linear(c, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(self.blocks(self.stem(x)), 1), 1))


def resnet18_bn(batch: int = 8, image: int = 64, width: int = 64, seed: int = 0):
    torch.manual_seed(seed)
    model = ResNet18(width).train()
    return model, (torch.randn(batch, 3, image, image),), CrossEntropyLoss(torch.randint(0, 10, (batch,)))


# -- MobileNetV3-small-style -----------------------------------------------------------------------

class SqueezeExcite(nn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        self.fc1 = nn.Conv2d(c, max(8, c // 4), 1)
        self.fc2 = nn.Conv2d(max(8, c // 4), c, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = F.adaptive_avg_pool2d(x, 1)
        return x * F.hardsigmoid(self.fc2(F.relu(self.fc1(s))))


class InvertedResidual(nn.Module):
    def __init__(self, c_in: int, expand: int, c_out: int, kernel: int, stride: int, se: bool, act: type) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        if expand != c_in:
            layers += [nn.Conv2d(c_in, expand, 1, bias=False), nn.BatchNorm2d(expand), act()]
        layers += [nn.Conv2d(expand, expand, kernel, stride, kernel // 2, groups=expand, bias=False),
                   nn.BatchNorm2d(expand), act()]
        if se:
            layers.append(SqueezeExcite(expand))
        layers += [nn.Conv2d(expand, c_out, 1, bias=False), nn.BatchNorm2d(c_out)]
        self.block = nn.Sequential(*layers)
        self.residual = stride == 1 and c_in == c_out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.block(x)
        return x + out if self.residual else out


# torchvision's mobilenet_v3_small settings: (kernel, expand, out, se, activation, stride)
_V3_SMALL = [(3, 16, 16, True, nn.ReLU, 2), (3, 72, 24, False, nn.ReLU, 2), (3, 88, 24, False, nn.ReLU, 1),
             (5, 96, 40, True, nn.Hardswish, 2), (5, 240, 40, True, nn.Hardswish, 1),
             (5, 240, 40, True, nn.Hardswish, 1), (5, 120, 48, True, nn.Hardswish, 1),
             (5, 144, 48, True, nn.Hardswish, 1), (5, 288, 96, True, nn.Hardswish, 2),
             (5, 576, 96, True, nn.Hardswish, 1), (5, 576, 96, True, nn.Hardswish, 1)]


class MobileNetV3Small(nn.Module):
    def __init__(self, classes: int = 10) -> None:
        super().__init__()
        layers: list[nn.Module] = [nn.Conv2d(3, 16, 3, 2, 1, bias=False), nn.BatchNorm2d(16), nn.Hardswish()]
        c = 16
        for kernel, expand, c_out, se, act, stride in _V3_SMALL:
            layers.append(InvertedResidual(c, expand, c_out, kernel, stride, se, act))
            c = c_out
        layers += [nn.Conv2d(c, 576, 1, bias=False), nn.BatchNorm2d(576), nn.Hardswish()]
        self.features = nn.Sequential(*layers)
        self.head = nn.Sequential(nn.Linear(576, 1024), nn.Hardswish(), nn.Dropout(0.2), nn.Linear(1024, classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.flatten(F.adaptive_avg_pool2d(self.features(x), 1), 1))


def mobilenet_v3_small(batch: int = 8, image: int = 96, seed: int = 0):
    torch.manual_seed(seed)
    model = MobileNetV3Small().train()
    return model, (torch.randn(batch, 3, image, image),), CrossEntropyLoss(torch.randint(0, 10, (batch,)))


# -- ViT with torch._assert shape checks ------------------------------------------------------------

class EncoderBlock(nn.Module):
    """Pre-norm transformer block: SDPA attention (dropout 0.1) and a GELU MLP."""

    def __init__(self, width: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.heads, self.dropout = heads, dropout
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width), nn.Dropout(dropout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, t, w = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(n, t, 3, self.heads, w // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0)
        x = x + self.proj(a.transpose(1, 2).reshape(n, t, w))
        return x + self.mlp(self.norm2(x))


class ViT(nn.Module):
    """A ViT in torchvision's style: patch conv, class token, pre-norm encoder with dropout, and
    ``torch._assert`` checks on shapes, one of them on a tensor condition."""

    def __init__(self, image: int, patch: int, width: int, layers: int, heads: int, classes: int = 10,
                 dropout: float = 0.1) -> None:
        super().__init__()
        self.image, self.patch = image, patch
        self.proj = nn.Conv2d(3, width, patch, patch)
        self.cls = nn.Parameter(torch.zeros(1, 1, width))
        self.pos = nn.Parameter(torch.randn(1, (image // patch) ** 2 + 1, width) * 0.02)
        self.drop = nn.Dropout(dropout)
        self.encoder = nn.Sequential(*(EncoderBlock(width, heads, dropout) for _ in range(layers)))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, c, h, w = x.shape
        torch._assert(h == self.image, f"Wrong image height! Expected {self.image} but got {h}!")
        torch._assert(torch.tensor(c) == 3, "expected RGB input")  # a tensor condition, as some ViTs write
        torch._assert(torch.isfinite(x).all(), "non-finite input")  # a check on the data itself
        x = self.proj(x).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls.expand(n, -1, -1), x], dim=1)
        x = self.encoder(self.drop(x + self.pos))
        return self.head(self.norm(x[:, 0]))


def vit_assert(batch: int = 8, image: int = 32, patch: int = 4, width: int = 128, layers: int = 2,
               heads: int = 4, dropout: float = 0.1, seed: int = 0):
    torch.manual_seed(seed)
    model = ViT(image, patch, width, layers, heads, dropout=dropout).train()
    return model, (torch.randn(batch, 3, image, image),), CrossEntropyLoss(torch.randint(0, 10, (batch,)))


# -- Hugging Face transformers, from configs -------------------------------------------------------

def _vocab_logits(logits_of):
    """A model wrapper returning plain logits (``loss_fn`` gets a tensor)."""

    class LogitsOnly(nn.Module):
        def __init__(self, inner: nn.Module) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return logits_of(self.inner, ids)

    return LogitsOnly


def gpt2(batch: int = 4, seq: int = 128, width: int = 128, layers: int = 2, heads: int = 4, vocab: int = 1000,
         dropout: float = 0.1, seed: int = 0):
    """``GPT2LMHeadModel`` (dropout 0.1, SDPA attention) with the next-token loss."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    config = GPT2Config(n_embd=width, n_layer=layers, n_head=heads, n_positions=seq, vocab_size=vocab,
                        resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout,
                        bos_token_id=0, eos_token_id=0, attn_implementation="sdpa")
    model = _vocab_logits(lambda m, ids: m(input_ids=ids).logits)(GPT2LMHeadModel(config)).train()
    ids = torch.randint(0, vocab, (batch, seq))
    return model, (ids,), CrossEntropyLoss(torch.roll(ids, -1, 1), flatten=True)


def bert_mlm(batch: int = 4, seq: int = 128, width: int = 128, layers: int = 2, heads: int = 4, vocab: int = 1000,
             dropout: float = 0.1, seed: int = 0):
    """``BertForMaskedLM`` (dropout 0.1; ``cls.predictions.bias`` is a tied alias of the decoder's
    bias that the forward pass never reads under that name)."""
    from transformers import BertConfig, BertForMaskedLM

    torch.manual_seed(seed)
    config = BertConfig(hidden_size=width, num_hidden_layers=layers, num_attention_heads=heads,
                        intermediate_size=4 * width, max_position_embeddings=seq, vocab_size=vocab,
                        hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout,
                        attn_implementation="sdpa")
    inner = BertForMaskedLM(config)
    model = _vocab_logits(lambda m, ids: m(input_ids=ids).logits)(inner).train()
    ids = torch.randint(0, vocab, (batch, seq))
    return model, (ids,), CrossEntropyLoss(ids, flatten=True)


# -- model code that reads a tensor's value -------------------------------------------------------

class ItemBranch(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.abs().max().item() > 100:  # a branch on a value: not traceable, refused with advice
            x = x / 100
        return self.lin(x)


def item_branch(batch: int = 4, seed: int = 0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(16, 16), ItemBranch())
    return model, (torch.randn(batch, 16),), CrossEntropyLoss(torch.randint(0, 10, (batch,)))
