"""Hugging Face ``transformers`` models as a model source: ``hf:ARCH`` and ``hf:PATH/config.json``.

``build(spec, **options) -> (model, example_inputs, loss_fn)``, the zoo's contract
(:func:`bonsai_core.models.build` dispatches ``hf:`` names here, after seeding). Each model is built
from its ``*Config`` and model class, never downloaded and without weights files; under
``FakeTensorMode`` (``bonsai trace``) no memory is allocated, and ``bonsai export``/``verify`` build
the same model with real, seeded weights.

The traced loss is the model's own training loss, through its ``labels`` path:

* causal LM (``gpt2``, ``llama``, ``mistral``, ``mixtral``): ``labels = input_ids``, which the model
  shifts by one (Mixtral's router loss is off, as in its config's default);
* masked LM (``bert``): 15% of the positions of each row (at least one), drawn from the seed, are
  replaced by the last token id, which stands for ``[MASK]``; ``labels`` holds the original token
  there and -100 (ignored) elsewhere; the other tokens are drawn from ``[0, vocab - 1)``;
* image classification (``vit``, ``resnet``): one class out of 10 per image;
* sequence-to-sequence LM (a ``config.json`` of T5, BART, ...): ``labels = input_ids``, which the
  model shifts right into the decoder's inputs (the decoder learns to reproduce the encoder's input:
  a real step's shapes and ops, through the model's own loss).

How the model is wrapped: :class:`WithLabels` holds the Hugging Face model as its submodule ``model``
(so its parameters keep their own names under ``model.``, e.g. ``model.transformer.h.0.attn.c_attn.weight``)
and the labels as a buffer; its ``forward(*inputs)`` calls the model with ``labels=`` and returns
``.loss``. The loss function is :class:`ModelLoss`, which returns that loss unchanged.

Size options, mapped onto each config (``bonsai zoo`` lists them with their defaults):

* ``width`` → ``n_embd``/``hidden_size``; the feed-forward size is 4 × width (``intermediate_size``,
  GPT-2's default ``n_inner``); ``layers`` → the number of blocks; ``heads`` → attention heads
  (Llama/Mistral/Mixtral: ``num_key_value_heads`` = heads / 2 when heads is even, grouped-query attention
  as in Llama 3, else heads); ``seq`` → the sequence length and ``max_position_embeddings`` /
  ``n_positions``; ``vocab`` → ``vocab_size``.
* ViT: ``image`` → ``image_size``, cut into an 8 × 8 grid of patches (``patch_size`` = image / 8).
* ResNet: ``width`` → the stem's channels; four stages of basic blocks with ``width × (1, 2, 4, 8)``
  channels and ``layers`` blocks each (ResNet-18 is width 64, layers 2).

Dropout stays at each config's default (0.1 for GPT-2 and BERT) and the model is in training mode.
Attention is what transformers trains with by default: SDPA (``attn_implementation="sdpa"``,
``F.scaled_dot_product_attention``) where the model class supports it, else eager. ``attention="eager"``
(``--attention eager``) asks for the model's own matmul / softmax / dropout ops, which keep a
``seq x seq`` score matrix per head for the backward pass; ``attention="sdpa"`` on a class without SDPA
is refused. On SDPA a causal LM gets no attention mask and is told that each row holds one sequence
(:func:`one_sequence_per_row`), so that the trace, like eager on real tensors, calls SDPA with
``is_causal=True`` and no mask (on fake tensors transformers cannot check the batch for padding and
would build, and the kernel keep, a ``batch x seq x seq`` mask). The trace records SDPA as the fused
kernels keep it: without dropout the CPU flash kernel (output and logsumexp per row), with dropout
(GPT-2's and BERT's 0.1) the memory-efficient kernel, which also keeps the generator's seed and offset
(:mod:`bonsai_core.attention`); an exported program runs each on the device of its batch.

``dtype`` (``--dtype bf16``, any model: :func:`bonsai_core.models.build`) builds the model in that type,
``model.to(torch.bfloat16)`` with float inputs cast too, next to ``--autocast bf16`` (float32 weights,
bf16 compute).

Mixture-of-experts models (a ``config.json`` of Mixtral, Qwen-MoE, ...) keep the experts implementation
their config asks for, else transformers' default ``"grouped_mm"``, the one they would train with:
``torch.nn.functional.grouped_mm`` over the tokens sorted by expert, static shapes, traced as eager
runs it (``bonsai_core.trace`` lets its float32 shapes through). No other is substituted: ``"eager"``
loops over the experts a batch hits (``nonzero``, data-dependent shapes) and cannot be traced on fake
tensors, and ``"batched_mm"`` gathers every token's expert weights, a different, far larger footprint.
"""

from __future__ import annotations

import contextlib
import json
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.nn as nn

from bonsai_core.errors import ModelError
from bonsai_core.models.entry import Built, ZooEntry, check_divisible
from bonsai_core.thread_patches import in_this_thread

PREFIX = "hf:"
# attn_implementation: "sdpa" (F.scaled_dot_product_attention, the default where the model class
# supports it) or "eager" (the model's own matmul / softmax / dropout ops)
ATTENTIONS = ("sdpa", "eager")
CLASSES = 10  # image classes of the built-in vision architectures
MASK_SHARE = 0.15  # BERT's share of masked positions
INSTALL = "pip install transformers==5.23.0"

# The training tasks whose loss bonsai knows: the model's `labels` path and what its inputs are.
CAUSAL_LM, MASKED_LM, IMAGE_CLASSIFICATION = "causal language modelling", "masked language modelling", "image classification"
SEQ2SEQ_LM = "sequence-to-sequence language modelling"
# transformers picks a loss from the class name's suffix; the seq2seq classes compute their own
_LOSS_TYPE = {CAUSAL_LM: "ForCausalLM", MASKED_LM: "ForMaskedLM", IMAGE_CLASSIFICATION: "ForImageClassification"}

# `no_init_weights` patches module globals; builds take turns (the explorer traces in threads).
_BUILD_LOCK = threading.Lock()


class WithLabels(nn.Module):
    """A Hugging Face model and its labels: ``forward(*inputs)`` is the model's own training loss.

    ``attention_mask``: pass an all-ones attention mask, as a tokenizer's batch without padding
    carries. ``one_sequence_per_row``: pass none and tell transformers that each row holds one
    sequence (:func:`one_sequence_per_row`)."""

    def __init__(self, model: nn.Module, input_names: tuple[str, ...], labels: torch.Tensor,
                 attention_mask: bool = False, one_sequence_per_row: bool = False) -> None:
        super().__init__()
        self.model = model
        self.input_names = input_names
        self.attention_mask = attention_mask
        self.one_sequence_per_row = one_sequence_per_row
        self.register_buffer("labels", labels)

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        kwargs = dict(zip(self.input_names, inputs))
        if self.attention_mask:  # what a tokenizer's batch carries (all ones: no padding)
            kwargs["attention_mask"] = torch.ones_like(inputs[0])
        with one_sequence_per_row() if self.one_sequence_per_row else contextlib.nullcontext():
            return self.model(**kwargs, labels=self.labels).loss


@contextlib.contextmanager
def one_sequence_per_row() -> Iterator[None]:
    """Within (this thread): transformers' check for several sequences packed into one row, made when
    a causal LM gets positions and no attention mask, answers "none" without reading the positions.

    A batch here has no padding and one sequence per row, and transformers would find that out by
    reading tensor values (``find_packed_sequence_indices``), which a trace on fake tensors does not
    have: there it assumes packing and builds a ``batch x seq x seq`` mask, which the SDPA kernels then
    read (and keep for the backward pass) where eager, seeing one sequence per row and no padding, calls
    SDPA with ``is_causal=True`` and no mask. With the answer given, the trace and eager both make
    the call eager makes."""
    from transformers import masking_utils

    with in_this_thread(masking_utils, "find_packed_sequence_indices", lambda position_ids: None):
        yield


@contextlib.contextmanager
def compiled_with_one_sequence_per_row(model: nn.Module) -> Iterator[None]:
    """Within: ``model`` may be compiled by ``torch.compile`` and still tell transformers that each row
    holds one sequence, as its eager and traced steps do (:func:`one_sequence_per_row`).

    Dynamo cannot enter the per-thread patch (a lock), so here the check is replaced for the whole
    process, where Dynamo traces the replacement, and the model's own patch is off. Compiling is not
    thread-safe in any case (it resets Dynamo's global state)."""
    from unittest import mock

    from transformers import masking_utils

    wrappers = [m for m in model.modules() if isinstance(m, WithLabels) and m.one_sequence_per_row]
    for wrapper in wrappers:
        wrapper.one_sequence_per_row = False
    try:
        with mock.patch.object(masking_utils, "find_packed_sequence_indices", lambda position_ids: None):
            yield
    finally:
        for wrapper in wrappers:
            wrapper.one_sequence_per_row = True


class ModelLoss(nn.Module):
    """The loss function of a model that returns its own loss: that loss, unchanged."""

    def forward(self, loss: torch.Tensor) -> torch.Tensor:
        return loss


# -- built-in architectures ----------------------------------------------------------------------

def _gpt2(batch: int = 8, seq: int = 128, width: int = 128, layers: int = 2, heads: int = 4,
          vocab: int = 512, *, attention: str | None = None) -> Built:
    from transformers import GPT2Config, GPT2LMHeadModel

    check_divisible(width, heads, "width")
    config = GPT2Config(n_layer=layers, n_embd=width, n_head=heads, n_positions=seq, vocab_size=vocab,
                        bos_token_id=vocab - 1, eos_token_id=vocab - 1)  # GPT-2's <|endoftext|> is its last id
    return _with_task(GPT2LMHeadModel, config, CAUSAL_LM, batch=batch, seq=seq, attention=attention)


def _bert(batch: int = 8, seq: int = 128, width: int = 128, layers: int = 2, heads: int = 4,
          vocab: int = 512, *, attention: str | None = None) -> Built:
    from transformers import BertConfig, BertForMaskedLM

    check_divisible(width, heads, "width")
    config = BertConfig(num_hidden_layers=layers, hidden_size=width, num_attention_heads=heads,
                        intermediate_size=4 * width, max_position_embeddings=seq, vocab_size=vocab)
    return _with_task(BertForMaskedLM, config, MASKED_LM, batch=batch, seq=seq, attention=attention)


def _llama(batch: int = 8, seq: int = 128, width: int = 128, layers: int = 2, heads: int = 4,
           vocab: int = 512, *, attention: str | None = None) -> Built:
    from transformers import LlamaConfig, LlamaForCausalLM

    return _with_task(LlamaForCausalLM, LlamaConfig(**_decoder_sizes(seq, width, layers, heads, vocab)),
                      CAUSAL_LM, batch=batch, seq=seq, attention=attention)


def _mistral(batch: int = 8, seq: int = 128, width: int = 128, layers: int = 2, heads: int = 4,
             vocab: int = 512, *, attention: str | None = None) -> Built:
    from transformers import MistralConfig, MistralForCausalLM

    return _with_task(MistralForCausalLM, MistralConfig(**_decoder_sizes(seq, width, layers, heads, vocab)),
                      CAUSAL_LM, batch=batch, seq=seq, attention=attention)


def _mixtral(batch: int = 8, seq: int = 128, width: int = 128, layers: int = 2, heads: int = 4,
             vocab: int = 512, *, attention: str | None = None) -> Built:
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(**_decoder_sizes(seq, width, layers, heads, vocab), num_local_experts=4,
                           num_experts_per_tok=2)
    return _with_task(MixtralForCausalLM, config, CAUSAL_LM, batch=batch, seq=seq, attention=attention)


def _decoder_sizes(seq: int, width: int, layers: int, heads: int, vocab: int) -> dict[str, int]:
    """Llama-family sizes: grouped-query attention with half as many key/value heads when it can."""
    check_divisible(width, heads, "width")
    if vocab < 3:
        raise ModelError(f"vocab={vocab} is too small: Llama-family models reserve token ids 1 and 2 (BOS, EOS).")
    return dict(num_hidden_layers=layers, hidden_size=width, num_attention_heads=heads,
                num_key_value_heads=heads // 2 if heads % 2 == 0 else heads, intermediate_size=4 * width,
                max_position_embeddings=seq, vocab_size=vocab)


def _vit(batch: int = 8, image: int = 32, width: int = 128, layers: int = 2, heads: int = 4, *,
         attention: str | None = None) -> Built:
    from transformers import ViTConfig, ViTForImageClassification

    check_divisible(width, heads, "width")
    check_divisible(image, 8, "image")
    config = ViTConfig(num_hidden_layers=layers, hidden_size=width, num_attention_heads=heads,
                       intermediate_size=4 * width, image_size=image, patch_size=image // 8, num_labels=CLASSES)
    return _with_task(ViTForImageClassification, config, IMAGE_CLASSIFICATION, batch=batch, image=image,
                      attention=attention)


def _resnet(batch: int = 8, image: int = 32, width: int = 16, layers: int = 2, *, attention: str | None = None) -> Built:
    from transformers import ResNetConfig, ResNetForImageClassification

    config = ResNetConfig(embedding_size=width, hidden_sizes=[width * 2**i for i in range(4)], depths=[layers] * 4,
                          layer_type="basic", num_labels=CLASSES)
    return _with_task(ResNetForImageClassification, config, IMAGE_CLASSIFICATION, batch=batch, image=image,
                      attention=attention)


ARCHS: dict[str, ZooEntry] = {e.name: e for e in [
    ZooEntry("gpt2", _gpt2, "GPT2LMHeadModel: GPT-2 decoder, causal LM loss, dropout 0.1"),
    ZooEntry("bert", _bert, "BertForMaskedLM: BERT encoder, masked LM loss on 15% of tokens, dropout 0.1"),
    ZooEntry("llama", _llama, "LlamaForCausalLM: RMSNorm, rotary, SwiGLU, grouped-query attention; causal LM"),
    ZooEntry("mistral", _mistral, "MistralForCausalLM: Llama-style decoder with sliding-window attention; causal LM"),
    ZooEntry("mixtral", _mixtral, "MixtralForCausalLM: Mistral whose feed-forward is 4 experts, 2 per token "
             "(grouped matmuls); causal LM"),
    ZooEntry("vit", _vit, "ViTForImageClassification: vision transformer on 8x8 patches, 10 classes"),
    ZooEntry("resnet", _resnet, "ResNetForImageClassification: basic blocks with BatchNorm, 10 classes"),
]}


# -- building ------------------------------------------------------------------------------------

def build(spec: str, attention: str | None = None, **options: Any) -> Built:
    """Build ``ARCH`` or ``PATH`` (a ``config.json`` or the folder holding one) with its batch and loss.

    ``attention``: "sdpa" or "eager" (:data:`ATTENTIONS`); None is SDPA where the model class supports
    it, else eager. The caller seeds torch first (:func:`bonsai_core.models.build` does). Raises
    ModelError for an unknown architecture, an unreadable or unsupported config, an option the model
    does not take, or a missing ``transformers``."""
    _require_transformers()
    if spec in ARCHS:
        ARCHS[spec].check_options(options, PREFIX + spec)
        return ARCHS[spec].factory(**options, attention=attention)
    path = Path(spec)
    if not (spec.endswith(".json") or "/" in spec or path.exists()):
        raise ModelError(f"Unknown Hugging Face architecture {spec!r}. Built in: "
                         + ", ".join(PREFIX + a for a in ARCHS) + f"; or give a model's config: {PREFIX}PATH/config.json "
                         "(or the folder holding it).")
    return build_from_config(load_config_file(path), source=str(path), attention=attention, **options)


def load_config_file(path: Path) -> dict[str, Any]:
    """The JSON object in ``path`` (or ``path/config.json``), read as data."""
    file = path / "config.json" if path.is_dir() else path
    try:
        text = file.read_text()
    except (OSError, UnicodeDecodeError) as e:
        reason = e.strerror if isinstance(e, OSError) else "it is not text"
        raise ModelError(f"Cannot read the model config {str(file)!r} ({reason}). Give {PREFIX}PATH where PATH "
                         "is a Hugging Face config.json or the folder holding one.") from None
    return parse_config(text, str(file))


def parse_config(text: str | bytes, source: str) -> dict[str, Any]:
    """A config.json's object, refusing what is not one (JSON only: nothing is executed)."""
    try:
        data = json.loads(text)
    except (ValueError, UnicodeDecodeError) as e:
        raise ModelError(f"{source} is not valid JSON ({e}). Give a Hugging Face config.json, as "
                         "`config.save_pretrained(folder)` writes it.") from None
    if not isinstance(data, dict) or not isinstance(data.get("model_type"), str):
        raise ModelError(f"{source} is not a Hugging Face model config: it needs a \"model_type\" "
                         "(like \"gpt2\"), as `config.save_pretrained(folder)` writes it.")
    return data


@dataclass(frozen=True)
class ConfigModel:
    """A user's config, read: the model it describes, its training task and the size options it takes."""

    config: Any
    model_class: type
    task: str
    options: dict[str, int]  # batch, and seq (text) or image (vision), with their defaults
    source: str

    def build(self, attention: str | None = None, **options: Any) -> Built:
        """The model with a batch and labels (see :func:`build`); refuses options that change its shape."""
        unknown = sorted(set(options) - set(self.options))
        if unknown:
            raise ModelError(f"{self.source} fixes the model's shape, so option(s) {', '.join(unknown)} do not apply: "
                             f"change them in the config instead. This model takes {', '.join(self.options)} "
                             "(defaults " + ", ".join(f"{k}={v}" for k, v in self.options.items()) + ").")
        sizes = {**self.options, **options}
        positions = _max_positions(self.config, self.model_class)
        if "seq" in sizes and sizes["seq"] > positions:
            raise ModelError(f"seq={sizes['seq']} is longer than the {positions} positions of {self.source}.")
        return _with_task(self.model_class, self.config, self.task, source=self.source, attention=attention, **sizes)


def read_config(data: dict[str, Any], source: str = "config.json") -> ConfigModel:
    """The model a config dict describes.

    The class comes from the config's ``architectures`` (or, without it, its ``model_type``: masked
    LM, else causal LM, else image classification) among those classes of ``transformers``; custom
    code (``auto_map``) is never loaded."""
    _require_transformers()
    import transformers
    from transformers import AutoConfig

    try:
        config = AutoConfig.for_model(**data)
    except Exception as e:  # unknown model_type, or a field of the wrong type (huggingface_hub's validation)
        raise ModelError(f"{source}: transformers cannot make a config from it ({e}). Check its \"model_type\" "
                         f"(does transformers {transformers.__version__} know it?) and its fields.") from None
    model_class, task = _model_class(config, source)
    sizes = {"image": getattr(config, "image_size", 224)} if task == IMAGE_CLASSIFICATION else \
        {"seq": min(128, _max_positions(config, model_class))}
    return ConfigModel(config, model_class, task, {"batch": 8, **sizes}, source)


def build_from_config(data: dict[str, Any], source: str = "config.json", attention: str | None = None,
                      **options: Any) -> Built:
    """Build the model a config dict describes, with its batch and loss: ``read_config(...).build(...)``."""
    return read_config(data, source).build(attention=attention, **options)


def _model_class(config: Any, source: str) -> tuple[type, str]:
    """The model class for a config, and its training task."""
    import transformers
    from transformers.models.auto import modeling_auto as auto

    # without "architectures", masked LM first: BERT-family types have both, and that is how they pretrain
    mappings = {MASKED_LM: auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES, CAUSAL_LM: auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
                IMAGE_CLASSIFICATION: auto.MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES,
                SEQ2SEQ_LM: auto.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES}
    classes = {name: task for task, mapping in mappings.items() for names in mapping.values()
               for name in ((names,) if isinstance(names, str) else names)}
    wanted = list(getattr(config, "architectures", None) or [])
    for name in wanted:
        if name in classes and hasattr(transformers, name):
            return getattr(transformers, name), classes[name]
    if not wanted:
        for task, mapping in mappings.items():
            names = mapping.get(config.model_type) or ("",)
            name = names if isinstance(names, str) else names[0]  # DeiT: (plain head, head with teacher)
            if name and hasattr(transformers, name):
                return getattr(transformers, name), task
    what = f"architectures {wanted}" if wanted else f"model_type {config.model_type!r}"
    raise ModelError(f"{source}: {what} is not supported. bonsai traces the training losses of causal LM "
                     "(...ForCausalLM, GPT2LMHeadModel), masked LM (...ForMaskedLM), sequence-to-sequence LM "
                     "(...ForConditionalGeneration of T5, BART, ...) and image classification "
                     "(...ForImageClassification) models of transformers; set \"architectures\" to one of those.")


def _max_positions(config: Any, model_class: type | None = None) -> int:
    """The longest sequence the config's position table holds. RoBERTa-style embeddings (a class of
    the model's module with ``create_position_ids_from_input_ids``) number positions from
    ``pad_token_id + 1``, so RoBERTa's 514 positions hold 512 tokens."""
    table = next((getattr(config, key) for key in ("max_position_embeddings", "n_positions", "n_ctx")
                  if isinstance(getattr(config, key, None), int)), 128)
    module = sys.modules.get(getattr(model_class, "__module__", ""), None)
    pad = getattr(config, "pad_token_id", None)
    offset = any(isinstance(obj, type) and hasattr(obj, "create_position_ids_from_input_ids")
                 for obj in vars(module).values()) if module is not None else False
    return table - pad - 1 if offset and isinstance(pad, int) else table


def attention_of(model_class: type, attention: str | None, source: str = "") -> str:
    """The attention implementation a model is built with: ``attention`` ("sdpa" or "eager"), or for
    None, SDPA where ``model_class`` supports it (what transformers picks by default), else eager."""
    if attention is None:
        return "sdpa" if getattr(model_class, "_supports_sdpa", False) else "eager"
    if attention not in ATTENTIONS:
        raise ModelError(f"attention={attention!r}; choose one of: {', '.join(ATTENTIONS)}.")
    if attention == "sdpa" and not getattr(model_class, "_supports_sdpa", False):
        raise ModelError(f"{source or model_class.__name__}: {model_class.__name__} has no SDPA attention in "
                         "transformers; use attention eager.")
    return attention


def _with_task(model_class: type, config: Any, task: str, batch: int, seq: int = 0, image: int = 0,
               source: str = "", attention: str | None = None) -> Built:
    """The model in training mode with a batch and labels for its task, wrapped as :class:`WithLabels`."""
    config._attn_implementation = attention = attention_of(model_class, attention, source)
    # A training step keeps no key/value cache (transformers turns it off under gradient checkpointing
    # too): a cache would grow again when a checkpointed attention is recomputed.
    if hasattr(config, "use_cache"):
        config.use_cache = False
    if task == IMAGE_CLASSIFICATION:
        config.problem_type = "single_label_classification"
    if task == SEQ2SEQ_LM and getattr(config, "decoder_start_token_id", None) is None:
        raise ModelError(f"{source or model_class.__name__}: the decoder's inputs are the labels shifted right behind "
                         "config.decoder_start_token_id, which this config does not set. Add it to the config "
                         f"(T5's checkpoints use the pad token, {getattr(config, 'pad_token_id', None)!r}).")
    try:
        model = _instantiate(model_class, config).train()
    except Exception as e:  # a user's config can reach any code path of the model class
        if not source:
            raise
        raise ModelError(f"{source}: building {model_class.__name__} from it failed ({type(e).__name__}: {e}). "
                         "Check the config's fields.") from None
    if task in _LOSS_TYPE:
        model.loss_type = _LOSS_TYPE[task]  # what its labels path computes (transformers guesses from the class name)
    if task in (CAUSAL_LM, SEQ2SEQ_LM):
        ids = torch.randint(0, config.vocab_size, (batch, seq))
        # Eager attention: a causal LM gets an all-ones mask (its packed-sequence check reads the
        # positions when there is none). SDPA: no mask and one sequence per row, so that the step calls
        # SDPA with is_causal=True and no mask, as eager does (one_sequence_per_row). T5's mask check
        # reads the mask's values when there is one.
        causal = task == CAUSAL_LM
        labelled = WithLabels(model, ("input_ids",), ids.clone(), attention_mask=causal and attention == "eager",
                              one_sequence_per_row=causal and attention == "sdpa")
        return labelled, (ids,), ModelLoss()
    if task == MASKED_LM:
        mask_id = config.vocab_size - 1
        ids = torch.randint(0, mask_id, (batch, seq))
        chosen = torch.rand(batch, seq).topk(max(1, round(MASK_SHARE * seq)), dim=1).indices
        masked = torch.zeros(batch, seq, dtype=torch.bool).scatter(1, chosen, True)
        labels = torch.where(masked, ids, torch.full_like(ids, -100))
        return WithLabels(model, ("input_ids",), labels), (torch.where(masked, mask_id, ids),), ModelLoss()
    channels = getattr(config, "num_channels", 3)
    pixels = torch.randn(batch, channels, image, image)
    labels = torch.randint(0, config.num_labels, (batch,))
    return WithLabels(model, ("pixel_values",), labels), (pixels,), ModelLoss()


def _instantiate(model_class: type, config: Any) -> nn.Module:
    """``model_class(config)``; on fake tensors, without weight initialisation (values do not exist
    there, and ``trunc_normal_`` reads them), then tied as the initialisation would have."""
    from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily
    from transformers.initialization import no_init_weights

    with _BUILD_LOCK:
        if not isinstance(torch.empty(0), FakeTensor):
            return model_class(config)
        with no_init_weights():
            try:
                model = model_class(config)
            except Exception as e:
                if type(e).__name__ != "DataDependentOutputException":
                    raise
                # The constructor reads a value it computed (ConvNeXt's drop-path rates:
                # `torch.linspace(...).tolist()`): build on real, uninitialised tensors instead, which
                # the trace takes as constants of the fake step (memory untouched until written).
                with unset_fake_temporarily():
                    model = model_class(config)
        model.tie_weights()
        return model


def _require_transformers() -> None:
    try:
        import transformers  # noqa: F401
    except ImportError:
        raise ModelError(f"hf: models need the transformers package: {INSTALL}.") from None

