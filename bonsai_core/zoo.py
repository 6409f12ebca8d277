"""Built-in models in plain PyTorch, each with a batch and a loss: what ``bonsai trace NAME`` traces.

``build(name, **options) -> (model, example_inputs, loss_fn)``: ``model(*example_inputs)`` is the
output and ``loss_fn(output)`` a scalar loss. ``loss_fn`` is an ``nn.Module`` whose targets are
buffers, so tracing lifts them as inputs instead of baking them in as constants. Everything is
deterministic under a fixed seed, and the defaults are small enough for a real CPU step in well
under a second while activations, not weights, dominate the peak.

Build options beside the sizes: ``dtype`` ("fp32", "bf16", "fp16"; any model) builds the model and
batch in that type (:func:`in_dtype`), and ``attention`` ("sdpa", "eager"; ``hf:`` models only) picks
the attention implementation (:func:`bonsai_core.hf.build`).

The zoo's convolutional models use no batch norm (they predate its support and their graphs are
pinned by tests); models with BatchNorm, dropout and tied weights come from ``hf:ARCH``
(:mod:`bonsai_core.hf`) or ``tests/real_models.py``.
"""

from __future__ import annotations

import importlib
import inspect
import math
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from bonsai_core.errors import BonsaiError, ModelError, ValueReadError


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

Built = tuple[nn.Module, tuple[torch.Tensor, ...], nn.Module]


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


def check_divisible(value: int, by: int, what: str) -> None:
    if value <= 0 or value % by:
        raise ModelError(f"{what}={value} must be a positive multiple of {by} for this model.")


@dataclass(frozen=True)
class ZooEntry:
    name: str
    factory: Callable[..., Built]
    description: str

    @property
    def options(self) -> dict[str, int]:
        """The model's size options and their defaults (the factory's parameters that are not
        keyword-only: a keyword-only one, like ``attention``, is a build choice, not a size)."""
        return {p.name: p.default for p in inspect.signature(self.factory).parameters.values()
                if p.kind is not p.KEYWORD_ONLY}

    def check_options(self, options: dict[str, Any], label: str) -> None:
        """Raise ModelError naming the options this model does not take, and the ones it does."""
        unknown = sorted(set(options) - set(self.options))
        if unknown:
            raise ModelError(f"Model {label} has no option {', '.join(map(repr, unknown))}; its options are "
                             + ", ".join(f"{k} (default {v})" for k, v in self.options.items()) + ".")


ZOO: dict[str, ZooEntry] = {e.name: e for e in [
    ZooEntry("mlp", _mlp, "multi-layer perceptron (Linear + GELU), classification"),
    ZooEntry("vgg", _vgg, "VGG-style conv net (3x3 conv + ReLU stages, max-pool), classification"),
    ZooEntry("resnet", _resnet, "ResNet-style net of residual conv blocks, classification"),
    ZooEntry("unet", _unet, "U-Net (conv encoder, transposed-conv decoder, skip concats), segmentation"),
    ZooEntry("gpt", _gpt, "GPT-2-style decoder-only transformer, next-token prediction"),
]}

# GPT-2 small's shape, for benchmarks (``build("gpt", **GPT2_SMALL)``).
GPT2_SMALL = dict(batch=8, seq=512, width=768, layers=12, heads=12, vocab=50257)


# ``dtype`` build option: the type of the parameters, floating buffers and floating inputs
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def build(name: str, seed: int = 0, **options: Any) -> Built:
    """Build a zoo model, a Hugging Face model (``hf:ARCH`` or ``hf:PATH/config.json``, see
    ``bonsai_core.hf``) or a ``package.module:factory`` callable, with its batch and loss.

    Options not given take the entry's defaults; unknown options raise ModelError. ``dtype`` (any
    model) and ``attention`` (``hf:`` models) are build options (module docstring).
    """
    dtype = options.pop("dtype", None)
    if dtype is not None and dtype not in DTYPES:
        raise ModelError(f"dtype={dtype!r}; choose one of: {', '.join(DTYPES)}.")
    return in_dtype(_build(name, seed, options), DTYPES[dtype] if dtype else None)


def in_dtype(built: Built, dtype: torch.dtype | None) -> Built:
    """``built`` with its floating parameters and buffers in ``dtype`` (what ``model.to(dtype)``
    makes), and its floating inputs and loss buffers too, as a training run in that type holds them.
    None: unchanged."""
    if dtype is None:
        return built
    model, inputs, loss_fn = built
    cast = tuple(x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x for x in inputs)
    if isinstance(loss_fn, nn.Module):
        _tensors_to(loss_fn, dtype)  # floating targets (integer class ids stay as they are)
    return _tensors_to(model, dtype), cast, loss_fn


def _tensors_to(module: nn.Module, dtype: torch.dtype) -> nn.Module:
    """``module`` with every floating parameter and buffer replaced by a copy in ``dtype``, a tied one
    (one tensor under several names) by one copy. ``module.to(dtype)`` does this for real tensors, but
    refuses parameters that are fake tensors (it swaps them, and the fake tensor mode holds weak
    references to them), so the trace, which builds on fake tensors, converts them here."""
    copies: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id -> (original, kept alive; copy)

    def copy(t: torch.Tensor, make: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        if id(t) not in copies:
            copies[id(t)] = (t, make(t))
        return copies[id(t)][1]

    for m in module.modules():
        for name, p in m._parameters.items():
            if p is not None and p.is_floating_point():
                m._parameters[name] = copy(p, lambda t: nn.Parameter(t.detach().to(dtype), t.requires_grad))
        for name, b in m._buffers.items():
            if b is not None and b.is_floating_point():
                m._buffers[name] = copy(b, lambda t: t.to(dtype))
    return module


def _build(name: str, seed: int, options: dict[str, Any]) -> Built:
    """:func:`build` without the ``dtype`` option."""
    is_hf = name.startswith("hf:")
    if "attention" in options and not is_hf:
        raise ModelError(f"Option attention applies to hf: models only; {name!r} is not one.")
    if ":" in name and not is_hf:
        return _build_factory(name, seed, **options)
    if not is_hf and name not in ZOO:
        raise ModelError(f"Unknown model {name!r}. Built-in models: {', '.join(ZOO)}; Hugging Face models: "
                         "hf:ARCH (see `bonsai zoo`) or hf:PATH/config.json; or pass "
                         "'package.module:factory' for a callable returning (model, example_inputs, loss_fn).")
    for key, value in options.items():
        if key == "attention" and is_hf:
            continue  # a name, checked by hf.build
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ModelError(f"Option {key}={value!r} of model {name!r} must be a positive whole number.")
    if is_hf:
        from bonsai_core import hf

        torch.manual_seed(seed)
        return hf.build(name[len("hf:"):], **options)
    entry = ZOO[name]
    entry.check_options(options, repr(name))
    torch.manual_seed(seed)
    return entry.factory(**options)


def _build_factory(spec: str, seed: int, **options: Any) -> Built:
    module_name, _, attr = spec.partition(":")
    try:
        factory = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as e:
        raise ModelError(f"Cannot load the model factory {spec!r} ({e}). Give 'package.module:function' "
                         "with the module importable (for a file in the current directory, run with PYTHONPATH=.).") from None
    torch.manual_seed(seed)
    call = f"{spec}({', '.join(f'{k}={v!r}' for k, v in options.items())})"
    try:
        built = factory(**options)
    except TypeError as e:
        raise ModelError(f"Calling {call} failed: {e}.") from None
    except BonsaiError:
        raise
    except Exception as e:  # the factory's own code: say where, never a traceback
        from bonsai_core.trace import DATA_DEPENDENT_ERRORS, user_code

        if type(e).__name__ in DATA_DEPENDENT_ERRORS:
            raise ValueReadError(f"Calling {call} failed in {user_code(e)} ({type(e).__name__}: {e}); it reads a "
                                 "tensor's value, which tracing (on fake tensors: shapes only) cannot give, so "
                                 "compute it from plain Python numbers.") from None
        raise ModelError(f"Calling {call} failed in {user_code(e)} ({type(e).__name__}: {e}).") from None
    if not (isinstance(built, tuple) and len(built) == 3 and isinstance(built[0], nn.Module)):
        raise ModelError(f"{spec} must return (model, example_inputs, loss_fn); it returned {type(built).__name__}.")
    model, inputs, loss_fn = built
    return model, tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,), loss_fn
