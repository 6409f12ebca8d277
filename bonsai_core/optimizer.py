"""The optimizer step that follows the backward pass: its state and the bytes its step allocates.

A training step is forward, backward, then ``optimizer.step()``. The optimizer's state lives through
the whole step (fixed memory, kind ``optimizer``), and its step allocates temporaries of its own after
the activations are gone, which can set the step's peak. These are PyTorch's rules for the
implementation a CUDA run uses by default (``foreach``: one kernel over every tensor of a (device,
dtype) group), as measured on that implementation by ``tests/test_optimizer.py``:

* ``adam`` / ``adamw``: state ``exp_avg`` and ``exp_avg_sq`` per trainable parameter (its dtype and
  shape); the step allocates one more tensor per parameter (``_foreach_sqrt(exp_avg_sq)``) for the
  whole group at once, so ``step_bytes`` = the trainable parameters' bytes. AdamW's weight decay is an
  in-place multiply; Adam is taken with its default ``weight_decay=0`` (a nonzero one adds a
  ``_foreach_add`` copy of the gradients). The ``step`` counters (4 B each) live on the CPU in a CUDA
  run and are not counted.
* ``sgd``: SGD with momentum (0.9, the usual setting): one ``momentum_buffer`` per parameter; the step
  updates in place (``step_bytes`` 0).
* ``none``: no optimizer in the step.

Between steps the gradients are zeroed in place (``zero_grad(set_to_none=False)``: their buffers are fixed
memory, the graph as traced) or set to None (``optimizer.zero_grad()``'s default): then each step makes
them in its backward pass and holds them to the optimizer step (:func:`with_grads_set_to_none`).

Parameters of several dtypes form several groups stepped one after another; this model takes them as
one group (an upper bound). ``make(params, name)`` builds the optimizer these rules describe.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterable

from bonsai_core.errors import BonsaiError
from bonsai_core.graph import Graph

if TYPE_CHECKING:  # torch is imported where an optimizer is built, so the CLI's parser stays light
    import torch

OPTIMIZERS = ("none", "sgd", "adam", "adamw")
STATES = {"none": (), "sgd": ("momentum_buffer",), "adam": ("exp_avg", "exp_avg_sq"),
          "adamw": ("exp_avg", "exp_avg_sq")}
STEP_TEMPORARIES = {"none": 0, "sgd": 0, "adam": 1, "adamw": 1}  # per byte of trainable parameters
SGD_MOMENTUM = 0.9


def check_name(name: str) -> str:
    if name not in OPTIMIZERS:
        raise BonsaiError(f"Unknown optimizer {name!r}; choose one of: {', '.join(OPTIMIZERS)}.")
    return name


def with_optimizer(graph: Graph, name: str) -> Graph:
    """``graph`` with ``name``'s state added to its fixed memory (one ``optimizer`` fixed tensor per
    state and parameter, after the others, as the first ``step()`` allocates them) and its step's
    temporaries recorded (``Graph.optimizer``). The trainable parameters are the graph's gradient
    buffers (fixed tensors of kind ``grad``), so the graph must come from ``bonsai trace``; each state tensor
    has its parameter's bytes (a fixed tensor of kind ``param`` of the gradient's name), else its gradient's."""
    check_name(name)
    if graph.optimizer is not None:
        raise BonsaiError(f"{graph.name!r} already has an optimizer ({graph.optimizer['name']}); trace it again "
                          "to choose another.")
    if name == "none":
        return graph
    grads = [(t[0].removesuffix(".grad"), t[1]) for t in graph.fixed_tensors if t[2] == "grad"]
    if not grads:
        raise BonsaiError(f"{graph.name!r} does not list its gradient buffers ('fixed_tensors' of kind 'grad'), "
                          "so its optimizer state is unknown: trace the model with `bonsai trace --optimizer`.")
    # torch's optimizers make their state zeros_like(param): on a tensor parallel rank an eager embedding's
    # gradient is replicated (DTensor's embedding backward) while its parameter and the state are sharded
    params = {t[0]: t[1] for t in graph.fixed_tensors if t[2] == "param"}
    sizes = [(param, params.get(param, nbytes)) for param, nbytes in grads]
    state = [(f"{param}.{s}", nbytes, "optimizer") for param, nbytes in sizes for s in STATES[name]]
    return graph.with_fields(fixed_tensors=[*map(list, graph.fixed_tensors), *map(list, state)],
                             fixed_mem=graph.fixed_mem + sum(t[1] for t in state),
                             optimizer={"name": name, "step_bytes": STEP_TEMPORARIES[name] * sum(b for _, b in sizes)})


ACCUMULATE_GRAD = "autograd.AccumulateGrad"  # a recorded step's node where autograd took a parameter's gradient
GRADS = ("zeroed", "none")  # between steps: zero_grad(set_to_none=False) / optimizer.zero_grad()'s default
# torchtitan's trainer calls optimizers.zero_grad() at each step's start (9dec370 of 2024-12 and 0.2.2), which sets
# them to None (torch's default set_to_none=True): a torchtitan step makes its sharded gradients in its backward
TORCHTITAN_GRADS = "none"


def grads_of(model: str, grads: str | None = None) -> str:
    """How the gradients are left between steps: ``grads`` where given, else the model spec's own training
    loop's: torchtitan's for a ``torchtitan:`` model, eager or compiled (:data:`TORCHTITAN_GRADS`), any
    other's ``"zeroed"`` (the graph as traced)."""
    if grads is not None:
        return grads
    return TORCHTITAN_GRADS if model.startswith("torchtitan:") else "zeroed"


def with_training_loop(graph: Graph, model: str, optimizer: str, grads: str | None = None) -> Graph:
    """``graph`` (traced from model spec ``model``, sharded and laid out as its rank holds it) in its training
    loop: ``optimizer``'s state and step (:func:`with_optimizer`), the gradients left between steps as ``grads``
    says, the model's own loop's where None (:func:`grads_of`: a torchtitan step sets them to None). The one
    place a graph built from a model spec gets both, in this order: the optimizer's state is read from the
    gradient buffers that setting them to None takes out of the fixed memory."""
    return with_grads(with_optimizer(graph, optimizer), grads_of(model, grads))


def with_grads(graph: Graph, grads: str) -> Graph:
    """``graph`` as a training loop that leaves its gradients ``grads`` between steps runs it: ``"zeroed"``
    (``zero_grad(set_to_none=False)``: the gradient buffers live through the step, ``fixed_mem``; the
    graph as traced) or ``"none"`` (set to None, ``optimizer.zero_grad()``'s default, as Hugging Face's
    Trainer and torchtitan call it): :func:`with_grads_set_to_none`."""
    if grads not in GRADS:
        raise BonsaiError(f"Unknown grads {grads!r}: give how the gradients are left between steps, "
                          f"{' or '.join(map(repr, GRADS))} (set to None, optimizer.zero_grad()'s default).")
    return graph if grads == "zeroed" else with_grads_set_to_none(graph)


def with_grads_set_to_none(graph: Graph) -> Graph:
    """``graph`` with its gradients set to None between steps (simulator rule 10): their buffers (fixed tensors of kind
    ``grad``) leave ``fixed_mem`` (``Graph.grads_set_to_none`` keeps their bytes: the optimizer step holds
    them), and each gradient is made in the backward pass and held from there to the end of the step.
    Eager's ``AccumulateGrad`` keeps the gradient it is handed as ``.grad`` (a copy where its layout is not
    the parameter's, the original then freed): the step's last node (no view nor separated output) holds
    every gradient node, which the graph frees at once otherwise (rule 2). On an FSDP rank the sharded
    gradient is the reduce-scatter's output, which FSDP2 then keeps instead of accumulating it into a
    gradient buffer (rule 7, :mod:`bonsai_core.fsdp`)."""
    if graph.grads_set_to_none:
        return graph
    grads = [t for t in graph.fixed_tensors if t[2] == "grad"]
    if not grads:
        raise BonsaiError(f"{graph.name!r} does not list its gradient buffers ('fixed_tensors' of kind 'grad'): "
                          "trace the model with `bonsai trace --grads none`.")
    data = graph.to_dict()
    data["fixed_tensors"] = [list(t) for t in graph.fixed_tensors if t[2] != "grad"]
    data["fixed_mem"] = graph.fixed_mem - sum(t[1] for t in grads)
    data["grads"] = {"set_to_none": True, "bytes": sum(t[1] for t in grads)}
    if graph.fsdp is None:
        gradients = gradient_nodes(graph)
        last = step_end(graph)
        held = [v for v in gradients if v != last]
        node = data["nodes"][last]
        node["deps"] = sorted(set(node["deps"]) | set(held))
        node["held"] = sorted(set(node.get("held", ())) | set(held))
    return Graph.rebuilt(data)


def step_end(graph: Graph) -> int:
    """The step's last node that is an op of its own (no view, no further output of an op)."""
    return next(v for v in range(graph.n - 1, -1, -1) if graph.alias_of[v] < 0 and graph.output_of[v] < 0)


def gradient_nodes(graph: Graph) -> list[int]:
    """The nodes of ``graph`` that make the parameters' gradients: the backward pass's outputs (nothing in the
    step reads a gradient); where they are set to None without FSDP (:func:`with_grads_set_to_none`), also
    the backward nodes the step's last node holds that nothing else reads. A recorded step (a compiled one,
    :mod:`bonsai_core.trace.recorder`) marks where ``AccumulateGrad`` took each gradient: those nodes alone,
    its other outputs being kernel outputs nothing reads, freed where they are made."""
    made = [v for v in range(graph.n) if graph.is_output[v] and not graph.is_forward[v]]
    if graph.grads_set_to_none and graph.fsdp is None:
        last = step_end(graph)
        made = sorted({*made, *(v for v in graph.held[last] if not graph.is_forward[v]
                                and graph.users(v).tolist() == [last])})
    taken = [v for v in made if graph.ops[v] == ACCUMULATE_GRAD]
    return taken or made


def make(params: Iterable[torch.nn.Parameter], name: str, lr: float = 1e-3) -> torch.optim.Optimizer | None:
    """The optimizer ``name`` stands for, as a CUDA run builds it by default (``foreach``)."""
    import torch

    params = list(params)
    check_name(name)
    if name == "none":
        return None
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=SGD_MOMENTUM, foreach=True)
    return (torch.optim.AdamW if name == "adamw" else torch.optim.Adam)(params, lr=lr, foreach=True)


def init_state(optimizer: torch.optim.Optimizer) -> int:
    """Allocate ``optimizer``'s state now, as its first ``step()`` would (zeros, the values that step
    starts from), so that it is fixed memory before a measured step; returns the bytes of its state
    (allocated now or by an earlier step: a later step's fixed memory holds it too). The first step then
    behaves exactly as without this (Adam's moments and SGD's momentum start at zero)."""
    import torch

    nbytes = 0
    for group in optimizer.param_groups:
        for p in group["params"]:
            if not p.requires_grad:
                continue
            if optimizer.state[p]:
                nbytes += sum(t.nbytes for k, t in optimizer.state[p].items() if k != "step" and isinstance(t, torch.Tensor))
                continue
            if isinstance(optimizer, torch.optim.SGD):
                state = {"momentum_buffer": torch.zeros_like(p, memory_format=torch.preserve_format)}
            else:
                state = {"step": torch.tensor(0.0),
                         "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                         "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format)}
            optimizer.state[p] = state
            nbytes += sum(t.nbytes for k, t in state.items() if k != "step")
    return nbytes
