"""torchtitan's Llama 3 as a model source: ``torchtitan:llama3:FLAVOUR``.

``build(spec, **options) -> (model, example_inputs, loss_fn)``, the zoo's contract
(:func:`bonsai_core.models.build` dispatches ``torchtitan:`` names here, after seeding). The model is
torchtitan's own ``Transformer`` (``torchtitan.models.llama3``), built from a flavour of its registry
(``llama3_args``: ``debugmodel``, ``8B``, ``70B``, ``405B``, ...), so its module paths are torchtitan's
(``layers.0.attention.wq``) and a plan made on it applies to the model a torchtitan run builds
(:func:`bonsai_core.torchtitan.plan_for`). The loss is torchtitan's: ``cross_entropy_loss`` (the
logits upcast to float32, summed over tokens) divided by the number of tokens, as its train step
divides by the valid tokens of the batch (:class:`TitanLoss`); the labels are the next tokens, as
torchtitan's dataloader gives them.

Size options: ``batch`` (local batch), ``seq`` (sequence length; the rotary table ``max_seq_len``
follows it, as torchtitan's ``update_from_config`` sets it), ``layers`` (``n_layers``), and to change
the flavour's shape ``width`` (``dim``), ``heads`` (``n_heads``) and ``vocab`` (``vocab_size``).

Attention: the release supported is torchtitan 0.2.2 (docs/MODELS.md says why), whose Llama 3 runs
``F.scaled_dot_product_attention`` (``attn_type="sdpa"``, causal, grouped-query), what the published
Dec-2024 runs used (flash). The trace records it as the CPU flash kernel, which keeps what the GPU's
flash kernel keeps for the backward pass: the output and one logsumexp per row
(:mod:`bonsai_core.attention`). The ``_flex_attn`` / ``_varlen_attn`` flavours are built with SDPA in
their place (a causal mask, not their per-document one): the trace runs on CPU, where flex attention
has no backward and varlen needs the CUDA flash kernel; both keep the same output and logsumexp, so
the saved bytes are theirs, the attention's compute on packed documents is not.

Weights: on fake tensors (``bonsai trace``) none are initialised; on real ones torchtitan's
``init_weights`` runs after the caller's seed.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.nn as nn

from bonsai_core.errors import ModelError
from bonsai_core.models.entry import Built, check_divisible

PREFIX = "torchtitan:"
INSTALL = "pip install --no-deps -r requirements-torchtitan.txt (README: torchtitan)"
SUPPORTED_RELEASE = "0.2.2"
FAMILIES = ("llama3",)
DEFAULTS = {"batch": 1, "seq": 2048}  # a size the debug flavours trace in a second or two
SIZE_OPTIONS = ("batch", "seq", "layers", "width", "heads", "vocab")
# the TransformerModelArgs field each shape option sets
_ARG_OF = {"layers": "n_layers", "width": "dim", "heads": "n_heads", "vocab": "vocab_size"}


class TitanLoss(nn.Module):
    """torchtitan's training loss on ``labels``: ``cross_entropy_loss(pred, labels)`` (float32 logits,
    summed) divided by the number of tokens (its train step's ``global_valid_tokens`` on one rank of
    data parallelism; a constant that scales the gradients and changes no tensor's size)."""

    def __init__(self, labels: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("labels", labels)

    def forward(self, pred: torch.Tensor) -> torch.Tensor:
        from torchtitan.components.loss import cross_entropy_loss

        return cross_entropy_loss(pred, self.labels) / self.labels.numel()


def flavours() -> dict[str, Any]:
    """The flavours of torchtitan's llama3 registry: name -> ``TransformerModelArgs``."""
    _require_torchtitan()
    from torchtitan.models.llama3 import llama3_args

    return dict(llama3_args)


def model_args(spec: str, layers: int | None = None, width: int | None = None, heads: int | None = None,
               vocab: int | None = None, seq: int = DEFAULTS["seq"]) -> Any:
    """The ``TransformerModelArgs`` of ``llama3:FLAVOUR`` with the size options applied, SDPA attention."""
    family, _, flavour = spec.partition(":")
    if family not in FAMILIES or not flavour:
        raise ModelError(f"Unknown torchtitan model {PREFIX + spec!r}: give {PREFIX}llama3:FLAVOUR, a flavour of "
                         "torchtitan's registry (" + ", ".join(flavours()) + ").")
    registry = flavours()
    if flavour not in registry:
        raise ModelError(f"torchtitan's llama3 has no flavour {flavour!r}; its flavours: {', '.join(registry)}.")
    args = registry[flavour]
    sizes = {_ARG_OF[k]: v for k, v in (("layers", layers), ("width", width), ("heads", heads), ("vocab", vocab))
             if v is not None}
    args = dataclasses.replace(args, **sizes, max_seq_len=seq, attn_type="sdpa", attn_mask_type="causal")
    check_divisible(args.dim, args.n_heads, "width")
    if args.n_kv_heads is not None and args.n_heads % args.n_kv_heads:
        raise ModelError(f"heads={args.n_heads} must be a multiple of the flavour's {args.n_kv_heads} key/value heads.")
    return args


def build(spec: str, batch: int = DEFAULTS["batch"], seq: int = DEFAULTS["seq"], **sizes: int) -> Built:
    """torchtitan's Llama 3 ``FLAVOUR`` (``spec`` is ``llama3:FLAVOUR``) in training mode, a batch of
    ``batch x seq`` tokens and :class:`TitanLoss` on them. The caller seeds torch first."""
    _require_torchtitan()
    unknown = sorted(set(sizes) - set(_ARG_OF))
    if unknown:
        raise ModelError(f"Model {PREFIX + spec} has no option {', '.join(map(repr, unknown))}; its options are "
                         + ", ".join(SIZE_OPTIONS) + f" (defaults batch={DEFAULTS['batch']}, seq={DEFAULTS['seq']}; "
                         "the others: the flavour's).")
    from torch._subclasses.fake_tensor import FakeTensor
    from torchtitan.models.llama3 import Transformer

    model = Transformer(model_args(spec, seq=seq, **sizes)).train()
    if not isinstance(model.output.weight, FakeTensor):
        with torch.no_grad():  # as torchtitan's trainer calls it
            model.init_weights()
    tokens = torch.randint(0, model.vocab_size, (batch, seq + 1))  # a sample; the labels are its next tokens
    return model, (tokens[:, :-1].clone(),), TitanLoss(tokens[:, 1:].clone())


def _require_torchtitan() -> None:
    try:
        import torchtitan
    except ImportError:
        raise ModelError(f"torchtitan: models need torchtitan {SUPPORTED_RELEASE} and the packages its model code "
                         f"imports: {INSTALL}.") from None
    if torchtitan.__version__ != SUPPORTED_RELEASE:
        raise ModelError(f"torchtitan {torchtitan.__version__} is installed; bonsai supports torchtitan "
                         f"{SUPPORTED_RELEASE} (docs/MODELS.md says why): {INSTALL}.")

