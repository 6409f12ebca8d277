"""Built-in models in plain PyTorch, each with a batch and a loss: what ``bonsai trace NAME`` traces.

Each entry of :data:`ZOO` builds ``(model, example_inputs, loss_fn)`` (:func:`bonsai_core.models.build`
seeds torch and checks the options first): ``model(*example_inputs)`` is the output and
``loss_fn(output)`` a scalar loss. ``loss_fn`` is an ``nn.Module`` whose targets are buffers, so
tracing lifts them as inputs instead of baking them in as constants. Everything is deterministic under
a fixed seed, and the defaults are small enough for a real CPU step in well under a second while
activations, not weights, dominate the peak.

The zoo's convolutional models use no batch norm (they predate its support and their graphs are
pinned by tests); models with BatchNorm, dropout and tied weights come from ``hf:ARCH``
(:mod:`bonsai_core.models.hf`) or ``tests/real_models.py``.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from bonsai_core.models.entry import Built, ZooEntry, check_divisible


class CrossEntropyLoss(nn.Module):
    """Cross-entropy against fixed targets held as a buffer (``loss_fn(output)``); the class scores
    are along dimension 1 (images, segmentation maps) unless ``flatten`` is set, for sequences
    ``(batch, seq, classes)``."""

    def __init__(self, target: torch.Tensor, flatten: bool = False) -> None:
        super().__init__()
        self.flatten = flatten
        self.register_buffer("target", target)

    def forward(self, logits: torch.Tensor) -> torch.Tensor:
        if self.flatten:
            return F.cross_entropy(logits.flatten(0, -2), self.target.flatten())
        return F.cross_entropy(logits, self.target)


class MSELoss(nn.Module):
    """Mean squared error against a fixed target held as a buffer."""

    def __init__(self, target: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("target", target)

    def forward(self, out: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(out, self.target)


# -- models --------------------------------------------------------------------------------------

class MLP(nn.Module):
    def __init__(self, d_in: int, width: int, layers: int, classes: int) -> None:
        super().__init__()
        dims = [d_in] + [width] * layers
        self.hidden = nn.ModuleList(nn.Linear(a, b) for a, b in zip(dims, dims[1:]))
        self.head = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.hidden:
            x = F.gelu(layer(x))
        return self.head(x)


class VGG(nn.Module):
    """VGG-style: stages of 3x3 conv + ReLU, max-pooling between stages, a linear classifier."""

    def __init__(self, width: int, layers: int, stages: int, classes: int, image: int) -> None:
        super().__init__()
        blocks: list[nn.Module] = []
        c_in = 3
        for s in range(stages):
            c_out = width * 2**s
            for _ in range(layers):
                blocks += [nn.Conv2d(c_in, c_out, 3, padding=1), nn.ReLU()]
                c_in = c_out
            blocks.append(nn.MaxPool2d(2))
        self.features = nn.Sequential(*blocks)
        self.head = nn.Linear(c_in * (image // 2**stages) ** 2, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).flatten(1))


class ResidualBlock(nn.Module):
    def __init__(self, c_in: int, c_out: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, padding=1)
        self.skip = nn.Conv2d(c_in, c_out, 1, stride=stride) if stride != 1 or c_in != c_out else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv2(F.relu(self.conv1(x)))
        return F.relu(y + (x if self.skip is None else self.skip(x)))


class ResNet(nn.Module):
    """ResNet-style: a stem, stages of two-conv residual blocks (stride 2 between stages), pooling."""

    def __init__(self, width: int, layers: int, stages: int, classes: int) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, width, 3, padding=1)
        blocks = []
        c = width
        for s in range(stages):
            c_out = width * 2**s
            for b in range(layers):
                blocks.append(ResidualBlock(c, c_out, 2 if (b == 0 and s > 0) else 1))
                c = c_out
        self.blocks = nn.Sequential(*blocks)
        self.head = nn.Linear(c, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.blocks(F.relu(self.stem(x)))
        return self.head(x.mean(dim=(2, 3)))


class UNet(nn.Module):
    """U-Net: an encoder of conv pairs with pooling, a decoder of transposed convs and skip concats."""

    def __init__(self, width: int, depth: int, classes: int) -> None:
        super().__init__()
        chans = [width * 2**i for i in range(depth + 1)]
        self.down = nn.ModuleList()
        c = 3
        for ch in chans:
            self.down.append(self._pair(c, ch))
            c = ch
        self.up = nn.ModuleList(nn.ConvTranspose2d(chans[i + 1], chans[i], 2, stride=2) for i in range(depth))
        self.dec = nn.ModuleList(self._pair(2 * chans[i], chans[i]) for i in range(depth))
        self.head = nn.Conv2d(chans[0], classes, 1)

    @staticmethod
    def _pair(c_in: int, c_out: int) -> nn.Module:
        return nn.Sequential(nn.Conv2d(c_in, c_out, 3, padding=1), nn.ReLU(),
                             nn.Conv2d(c_out, c_out, 3, padding=1), nn.ReLU())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skips = []
        for i, block in enumerate(self.down):
            x = block(x)
            if i < len(self.down) - 1:
                skips.append(x)
                x = F.max_pool2d(x, 2)
        for up, dec, skip in zip(reversed(self.up), reversed(self.dec), reversed(skips)):
            x = dec(torch.cat([up(x), skip], dim=1))
        return self.head(x)


class CausalSelfAttention(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(c // self.heads))
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        att = F.softmax(att.masked_fill(~mask, float("-inf")), dim=-1)
        y = (att @ v).transpose(1, 2).reshape(b, t, c)
        return self.proj(y)


class TransformerBlock(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.attn = CausalSelfAttention(width, heads)
        self.fc, self.out = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    """GPT-2-style decoder: token + position embeddings, pre-norm blocks, a tied-free LM head."""

    def __init__(self, vocab: int, seq: int, width: int, layers: int, heads: int) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, width), nn.Embedding(seq, width)
        self.blocks = nn.ModuleList(TransformerBlock(width, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


# -- the zoo -------------------------------------------------------------------------------------

def _mlp(batch: int = 1024, width: int = 256, layers: int = 6) -> Built:
    model = MLP(64, width, layers, 10)
    x = torch.randn(batch, 64)
    return model, (x,), CrossEntropyLoss(torch.randint(0, 10, (batch,)))


def _vgg(batch: int = 16, width: int = 16, layers: int = 2, image: int = 32) -> Built:
    stages = 3
    check_divisible(image, 2**stages, "image")
    model = VGG(width, layers, stages, 10, image)
    x = torch.randn(batch, 3, image, image)
    return model, (x,), CrossEntropyLoss(torch.randint(0, 10, (batch,)))


def _resnet(batch: int = 16, width: int = 16, layers: int = 2, image: int = 32) -> Built:
    model = ResNet(width, layers, 3, 10)
    x = torch.randn(batch, 3, image, image)
    return model, (x,), CrossEntropyLoss(torch.randint(0, 10, (batch,)))


def _unet(batch: int = 4, width: int = 16, layers: int = 3, image: int = 64) -> Built:
    check_divisible(image, 2**layers, "image")
    model = UNet(width, layers, 4)
    x = torch.randn(batch, 3, image, image)
    return model, (x,), CrossEntropyLoss(torch.randint(0, 4, (batch, image, image)))


def _gpt(batch: int = 8, seq: int = 128, width: int = 128, layers: int = 2, heads: int = 4,
         vocab: int = 512) -> Built:
    check_divisible(width, heads, "width")
    model = GPT(vocab, seq, width, layers, heads)
    idx = torch.randint(0, vocab, (batch, seq + 1))
    return model, (idx[:, :-1].contiguous(),), CrossEntropyLoss(idx[:, 1:].contiguous(), flatten=True)


ZOO: dict[str, ZooEntry] = {e.name: e for e in [
    ZooEntry("mlp", _mlp, "multi-layer perceptron (Linear + GELU), classification"),
    ZooEntry("vgg", _vgg, "VGG-style conv net (3x3 conv + ReLU stages, max-pool), classification"),
    ZooEntry("resnet", _resnet, "ResNet-style net of residual conv blocks, classification"),
    ZooEntry("unet", _unet, "U-Net (conv encoder, transposed-conv decoder, skip concats), segmentation"),
    ZooEntry("gpt", _gpt, "GPT-2-style decoder-only transformer, next-token prediction"),
]}

# GPT-2 small's shape, for benchmarks (``build("gpt", **GPT2_SMALL)``).
GPT2_SMALL = dict(batch=8, seq=512, width=768, layers=12, heads=12, vocab=50257)

