"""The README.md written into every export folder, one per back-end: how to train with it and check it."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

from bonsai_core.schedule import Schedule


def verify_options(info: dict[str, Any]) -> str:
    """The model options of the export's ``INFO`` as ``bonsai verify`` flags (``--batch 8 --autocast bf16``)."""
    opts = " ".join(f"--{k} {v}" for k, v in (info.get("options") or {}).items())
    if info.get("autocast"):
        opts += f" --autocast {info['autocast']}"
    return opts


def replay_readme(info: dict[str, Any], schedule: Schedule, folder: Path) -> str:
    """The replay back-end's README: the program replays the schedule's aten ops."""
    from bonsai_core.units import format_bytes

    model = info.get("model", "MODEL")
    opts = verify_options(info)
    regions = ""
    if "segments" in schedule.extra:
        regions = (f"\nThe schedule is a checkpoint-region plan: {len(schedule.extra['segments'])} segments, "
                   f"{len(schedule.extra.get('recomputed', []))} recomputed (``extra`` in schedule.json). The program "
                   "rebuilds each recomputed region once, right before the first backward op that needs it.\n")
    return f"""# Checkpointed `{model}` ({info['method']} schedule)

Made by `bonsai export` for graph `{info['graph']}` (hash `{info['graph_hash']}`).
Predicted peak: **{format_bytes(info['predicted_peak'])}** ({info['predicted_peak']} bytes, of which
{format_bytes(info['fixed_mem'])} fixed: parameters, gradients, buffers, the batch); {info['recomputes']}
recomputations, compute overhead {info['overhead']:+.2%}.
{regions}
## Train with it (plain PyTorch, no bonsai needed)

```python
import sys; sys.path.insert(0, "{folder}")  # this folder
import checkpointed

ck = checkpointed.load(model)          # shares model's parameters
loss = ck(*inputs, loss_fn=loss_fn)    # same loss as loss_fn(model(*inputs))
loss.backward()                        # scheduled backward; gradients land in model's .grad
optimizer.step(); optimizer.zero_grad()
```

* The schedule covers the whole step, loss included, so `ck` computes the loss: pass the same kind of
  loss module you traced with (an `nn.Module` holding its targets as buffers; new targets per batch
  are fine). Under `torch.no_grad()`, `ck(*inputs)` is just `model(*inputs)`.
* Inputs, parameters and targets must have the traced shapes and dtypes (the schedule and its memory
  are made for them); `ck` raises a clear error otherwise.
* Dropout and other random ops draw the same numbers when the schedule recomputes them (the
  generator state of their first computation is restored around each recomputation); under one
  `torch.manual_seed` the step equals the original's bitwise. Buffer updates (BatchNorm running
  statistics) are written into `model`'s buffers as eager training writes them. Tensors the model
  created while traced are in `constants.pt` (if present; keep it next to `checkpointed.py`).
* {"The step was traced under `torch.autocast` (" + str(info.get("autocast")) + "): the casts are in the program, which runs them whether or not you wrap the call in autocast; `GradScaler` works as usual." if info.get("autocast") else "The step was traced in full precision (no autocast); to train under autocast, trace and export with `--autocast bf16|fp16`."}
* Gradients reach autograd one by one, the moment the schedule computes them, so parameter hooks
  `DistributedDataParallel` and FSDP2 work: wrap the checkpointed module, `DDP(ck)` or
  `fully_shard(ck)`, not `model`.
  `load(model, grads="direct")` writes `.grad` itself instead, bypassing autograd and its hooks.

## Check it on your GPU

```
bonsai verify {model} {opts} {folder} --device cuda
```

runs the original and this model side by side and prints the loss difference, the largest
gradient difference, the predicted peak and the measured peak (`torch.cuda.max_memory_allocated`),
with `.grad` pre-allocated and with `.grad` None, and the wall time of both steps.
Without bonsai installed, measure it yourself: `torch.cuda.reset_peak_memory_stats()`, one step as
above, then `torch.cuda.max_memory_allocated()` (with `.grad` already allocated, as in steady-state
training). `max_memory_allocated` also counts what the simulator does not model: the caching
allocator's rounding of block sizes, and workspaces that cuBLAS and cuDNN (convolutions) allocate
through it. On CPU (`bonsai verify ... --device cpu`) the measured peak matches the prediction.
"""


def checkpoint_readme(info: dict[str, Any], units: Sequence[tuple[str, int, int, int]], folder: Path) -> str:
    """The checkpoint back-end's README: which submodules it checkpoints (``units``: path, aten ops per
    forward, ops saved, dropped bytes recomputed), and what stays saved."""
    from bonsai_core.units import format_bytes

    model = info["model"]
    opts = verify_options(info)
    rows = "\n".join(f"| `{path}` | {ops} | {saved} | {format_bytes(dropped)} |" for path, ops, saved, dropped in units)
    rows = rows or "| (none: the plan recomputes nothing) | | | |"
    unrealised = ""
    if info.get("unrealised_dropped_nodes"):
        unrealised = (f"\n{info['unrealised_dropped_nodes']} dropped tensor(s) of the plan "
                      f"({format_bytes(info['unrealised_dropped_bytes'])}) "
                      "are not held by any submodule short of the whole model together with their readers (or are "
                      "computed by the loss), so they stay saved: the real peak can exceed the prediction by up to "
                      "that much.\n")
    for path, why in (info.get("not_checkpointed") or {}).items():
        unrealised += f"\n`{path}` is not checkpointed: {why}.\n"
    if info.get("offloaded_tensors") or info.get("offloads_kept_on_device"):
        unrealised += (f"\nOffloaded to host memory: {info.get('offloaded_tensors', 0)} saved tensor(s), "
                       f"{format_bytes(info.get('offloaded_bytes', 0))} ({info.get('offloaded_bytes', 0)} bytes; host "
                       f"peak {format_bytes(info.get('host_peak', 0))}), copied to host when autograd saves them and "
                       "back when the backward pass reads them (`OFFLOAD` in `checkpointed.py`)"
                       + (f"; {info['offloads_kept_on_device']} tensor(s) the plan offloads stay on the device (a "
                          "checkpointed submodule holds them, or the run does not make them as traced), and the "
                          "predicted peak counts them there" if info.get("offloads_kept_on_device") else "") + ".\n")
    return f"""# Checkpointed `{model}` ({info['method']} schedule, checkpoint back-end)

Made by `bonsai export --backend checkpoint` for graph `{info['graph']}` (hash `{info['graph_hash']}`).
Predicted peak at the traced size: **{format_bytes(info['predicted_peak'])}** ({info['predicted_peak']} bytes, of
which {format_bytes(info['fixed_mem'])} fixed); compute overhead {info['overhead']:+.2%}.

## Train with it

```python
import importlib.util
spec = importlib.util.spec_from_file_location("checkpointed", "{folder}/checkpointed.py")
checkpointed = importlib.util.module_from_spec(spec); spec.loader.exec_module(checkpointed)

checkpointed.apply(model)               # your own module, checkpointed in place
loss = loss_fn(model(*inputs))          # any batch size; torch.autocast works
loss.backward(); optimizer.step(); optimizer.zero_grad()
```

## What it checkpoints

| submodule | aten ops per forward | ops saved | dropped bytes recomputed |
| --- | --- | --- | --- |
{rows}
{unrealised}
Each submodule runs under `torch.utils.checkpoint.checkpoint(use_reentrant=False)` with a selective
policy (`SAVE` in `checkpointed.py`): the tensors the schedule keeps are saved, the rest is recomputed
when the backward pass reaches the submodule.

## Check it

```
bonsai verify {model} {opts} {folder}
```
"""
