"""A bonsai plan in a torchtitan run: :func:`plan_for` plans one training step of torchtitan's Llama 3
(:mod:`bonsai_core.models.torchtitan`) for ``Plan.apply`` to checkpoint in place of torchtitan's
``apply_ac``, before its ``fully_shard`` (docs/REAL_RUNS.md shows the ``parallelize_fn``)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from bonsai_core.fsdp import Sharding
from bonsai_core.models.torchtitan import PREFIX, TitanLoss
from bonsai_core.optimizer import grads_of
from bonsai_core.training import Plan, plan


def plan_for(model: nn.Module, batch: int, seq: int, budget: str | int, method: str = "bonsai", *,
             fsdp: int = 1, optimizer: str = "adamw", reshard_after_forward: bool | str | None = None,
             mixed_precision: str | None = None, grads: str | None = None, tp: int = 1, cp: int = 1, pp: int = 1,
             dp_replicate: int = 1, **options: Any) -> Plan:
    """A checkpoint plan (:func:`bonsai_core.plan`) for one training step of torchtitan's Llama 3
    ``model`` on a local batch of ``batch x seq`` tokens with torchtitan's loss, as one of ``fsdp``
    ranks holds it (``optimizer``'s state sharded too), sharded as torchtitan 0.2.2's ``apply_fsdp`` shards
    it (by default, None: ``"torchtitan"``, :func:`bonsai_core.fsdp.fsdp_units`; ``True`` for
    ``fully_shard`` on each block and the model alone) under FSDP2's mixed precision as torchtitan sets it
    (``training.mixed_precision_param``, bfloat16 by default; ``mixed_precision="none"`` for an fp32 run),
    torchtitan's setting as :meth:`bonsai_core.fsdp.Sharding.of` gives it for a ``torchtitan:`` model. ``model`` is the ``Transformer`` torchtitan
    built, on any device (``meta`` too: only shapes are read), before ``parallelize_llama``. The gradients
    are left between steps as torchtitan's trainer leaves them by default (None: ``optimizers.zero_grad()`` sets
    them to None, :func:`bonsai_core.optimizer.grads_of`, eager or compiled); ``grads="zeroed"``
    for a loop that zeroes them in place.

    ``plan.apply(model)`` then does what torchtitan's ``apply_ac`` does, one save policy per block
    (``model.layers.<i>``, and whichever smaller submodules the plan picks), in place: the module
    paths stay torchtitan's, so its ``apply_fsdp`` (``fully_shard``), which must come after, finds
    them. Run torchtitan with ``activation_checkpoint.mode = "none"`` so that it does not wrap the
    blocks again (docs/REAL_RUNS.md shows the ``parallelize_fn`` that does both).

    ``tp``, ``cp``, ``pp`` and ``dp_replicate`` (and ``options``' ``pp_schedule``, ``microbatches``, ``rank``)
    complete the layout, as torchtitan's ``ParallelDims`` (``fsdp`` is its ``dp_shard``): the plan is then
    one rank's, tensor and context parallel applied as ``parallelize_llama`` applies them and FSDP over
    ``fsdp x cp`` ranks (:mod:`bonsai_core.parallel`); with ``pp``, ``model`` is the rank's model part(s) as
    torchtitan's pipeline split makes them (:mod:`bonsai_core.pipeline`)."""
    device = next(model.parameters()).device
    tokens = torch.zeros(batch, seq, dtype=torch.long, device=device)
    sharding = Sharding.of(fsdp * cp, reshard_after_forward, mixed_precision, model="torchtitan:")  # FSDP: dp_shard x cp
    return plan(model, (tokens,), TitanLoss(tokens.clone()), budget, method, fsdp=fsdp, optimizer=optimizer,
                reshard_after_forward=sharding.reshard_after_forward, mixed_precision=sharding.mixed_precision,
                 grads=grads_of(PREFIX, grads), tp=tp, cp=cp, pp=pp, dp_replicate=dp_replicate, **options)
