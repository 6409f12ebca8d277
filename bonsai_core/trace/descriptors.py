"""The joint graph of a step whose parameters are DTensors (tensor or context parallel on a device mesh).

``aot_export_module`` refuses tensor subclasses; ``aot_export_joint_with_descriptors`` (the export
torch's autoparallel work uses) takes them: it unwraps every DTensor into its local tensor, so the
joint graph is one rank's program, its local shards, the collectives DTensor issues
(``_c10d_functional.all_gather_into_tensor``, ``reduce_scatter_tensor``, ``all_reduce``, each
followed by ``wait_tensor``) and the local kernels. Its placeholders and outputs carry descriptors
instead of a graph signature; :func:`signature_of` reads them into the four maps
:mod:`bonsai_core.trace.to_graph` reads from ``aot_export_module``'s signature, so the rest of the
trace is the same for both."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn

# a DTensor unwraps into these placeholders: its local tensor, and its mesh (not a tensor)
LOCAL = "_local_tensor"


@dataclass
class BackwardSignature:
    gradients_to_parameters: dict[str, str] = field(default_factory=dict)


@dataclass
class Signature:
    """What :mod:`bonsai_core.trace.to_graph` reads of ``aot_export_module``'s graph signature, from
    descriptors: placeholders of parameters and buffers (their local tensors), the batch's, the loss
    output, buffers written, and which output is which parameter's gradient."""

    inputs_to_parameters: dict[str, str] = field(default_factory=dict)
    inputs_to_buffers: dict[str, str] = field(default_factory=dict)
    user_inputs: list[str] = field(default_factory=list)
    user_outputs: list[str] = field(default_factory=list)
    buffers_to_mutate: dict[str, str] = field(default_factory=dict)
    backward_signature: BackwardSignature = field(default_factory=BackwardSignature)
    tangents: list[str] = field(default_factory=list)  # the loss's seed gradient: an input of this export


class SentOutput(nn.Module):
    """The "loss" of a pipeline stage that is not the last: its output itself, sent to the next stage,
    whose gradient comes back from it (the export's tangent input)."""

    def forward(self, output: torch.Tensor) -> torch.Tensor:
        return output


def needs_descriptors(step: nn.Module) -> bool:
    """Whether ``step`` (model and loss) must be exported with descriptors: its parameters are DTensors, or
    its output is sent on (:class:`SentOutput`). An input that needs a gradient (a user's initial states, a
    last stage's received activation) does not: ``aot_export_module`` traces its gradient as eager runs it."""
    from torch.distributed.tensor import DTensor

    return (any(isinstance(t, DTensor) for t in (*step.parameters(), *step.buffers()))
            or any(isinstance(m, SentOutput) for m in step.modules()))


def export_joint(step: nn.Module, inputs: tuple[torch.Tensor, ...]) -> tuple[fx.GraphModule, Signature]:
    """The joint forward + backward graph of ``step`` (its one output the loss), and its signature."""
    from torch._functorch.aot_autograd import aot_export_joint_with_descriptors

    with contextlib.ExitStack() as stack:
        joint = aot_export_joint_with_descriptors(stack, step, inputs)
        gm = joint.graph_module
    return gm, signature_of(gm)


def _unwrapped(desc: Any) -> tuple[Any, bool]:
    """The descriptor a subclass attribute was unpacked from, and whether it is the local tensor."""
    from torch._functorch._aot_autograd.descriptors import SubclassGetAttrAOTInput, SubclassGetAttrAOTOutput

    local = True
    while isinstance(desc, (SubclassGetAttrAOTInput, SubclassGetAttrAOTOutput)):
        local = local and desc.attr == LOCAL
        desc = desc.base
    return desc, local


def signature_of(gm: fx.GraphModule) -> Signature:
    from torch._functorch._aot_autograd.descriptors import (BufferAOTInput, GradAOTOutput, InputMutationAOTOutput,
                                                            ParamAOTInput, PlainAOTInput, PlainAOTOutput,
                                                            TangentAOTInput)

    sig = Signature()
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            desc, local = _unwrapped(node.meta.get("desc"))
            if not local:
                continue
            if isinstance(desc, ParamAOTInput):
                sig.inputs_to_parameters[node.name] = desc.target
            elif isinstance(desc, BufferAOTInput):
                sig.inputs_to_buffers[node.name] = desc.target
            elif isinstance(desc, PlainAOTInput):
                sig.user_inputs.append(node.name)
            elif isinstance(desc, TangentAOTInput):
                sig.tangents.append(node.name)
        elif node.op == "output":
            for out, raw in zip(node.args[0], node.meta.get("desc", ())):
                desc, local = _unwrapped(raw)
                if not local or not isinstance(out, fx.Node):
                    continue
                if isinstance(desc, PlainAOTOutput):
                    sig.user_outputs.append(out.name)
                elif isinstance(desc, GradAOTOutput) and isinstance(desc.grad_of, ParamAOTInput):
                    sig.backward_signature.gradients_to_parameters[out.name] = desc.grad_of.target
                elif isinstance(desc, InputMutationAOTOutput):
                    mutated, _ = _unwrapped(desc.mutated_input)
                    if isinstance(mutated, BufferAOTInput):
                        sig.buffers_to_mutate[out.name] = mutated.target
    return sig
