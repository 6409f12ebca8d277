"""Is the dropout gap of docs/results/predicted_vs_measured.md only CPU eager's dropout kernel?

Measures the eager CPU step of the dropout-0.1 real models with dropout run as ``native_dropout``
(the fused kernel, bool mask, that CUDA eager uses and the trace records), also inside SDPA (its math
form: softmax(QK^T/sqrt(d) + causal mask) @ V with the dropout in between), and of ``hf:gpt2`` and
``hf:bert`` at their default sizes (eager attention: its dropout is ``F.dropout``):
``python scripts/dropout_kernel_check.py``."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from bonsai_core import models
from bonsai_core.measure import measure_step
from bonsai_core.schedule import no_remat_peak
from bonsai_core.trace import trace_model


class Fused(TorchFunctionMode):
    """F.dropout and SDPA with dropout, run with native_dropout."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.dropout:
            x, p = args[0], kwargs.get("p", args[1] if len(args) > 1 else 0.5)
            training = kwargs.get("training", args[2] if len(args) > 2 else True)
            if training and p > 0:
                return torch.native_dropout(x, p, True)[0]
        if func is F.scaled_dot_product_attention and kwargs.get("dropout_p", 0) > 0:
            q, k, v = args[:3]
            a = torch.softmax(q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5 + (torch.full((q.shape[-2], k.shape[-2]), float("-inf")).triu(1) if kwargs.get("is_causal") else 0), -1)
            return torch.native_dropout(a, kwargs["dropout_p"], True)[0] @ v
        return func(*args, **kwargs)


for spec in ("tests.real_models:vit_assert", "tests.real_models:gpt2", "tests.real_models:bert_mlm", "hf:gpt2", "hf:bert"):
    traced = trace_model(spec)
    g = traced.graph
    m, i, l = models.build(spec)
    with Fused():
        r = measure_step(m, i, l, frozen=traced.frozen_params)
    print(spec, no_remat_peak(g), r.peak, no_remat_peak(g) / r.peak, flush=True)
