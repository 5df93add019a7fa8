"""Low-precision copies of a model's matmul weights, cast once per update instead of per forward.

Under bf16 autocast over float32 weights, every forward casts each ``nn.Linear`` weight to bf16
(16 GB read, 8 GB written for a 4B model), and each backward turns the bf16 weight gradient into a
new float32 tensor (``ToCopyBackward``) that is then added to ``.grad``: about 96 GB of memory
traffic per pass that does no arithmetic, and three kernel launches
per linear layer. Megatron and verl keep bf16 compute weights and accumulate their gradients into
float32 buffers instead. ``ComputeWeights`` does that for one update: it swaps each float32
``nn.Linear`` weight for a bf16 copy (made once), and a hook adds each pass's bf16 gradient of the
copy into the float32 master's ``.grad`` as soon as it is accumulated.

The arithmetic is the same as autocast's: the copy is the value autocast would cast to (the same
rounding), the matmuls see the same operands, the bf16 weight gradient is the same, and adding it
to a float32 ``.grad`` in place computes what converting it first and then adding does. Where two
modules share a weight (tied embeddings: the embedding reads the float32 master, the head the
copy), the two gradients reach ``.grad`` as two additions rather than one sum, which can differ in
the last bit.

One module is called several times in a pass: the output head (the log-probs are computed in
chunks, and the switch terms read it again; ``rollout/logprobs.py``). Autocast casts its weight
anew in each call (a checkpointed chunk recomputes its own cast), so each call's gradient becomes
float32 on its own and the calls add up in float32. A single bf16 copy would instead gather every
call's gradient in its autograd input buffer, summed in bf16, before the hook sees it: the head's
step then differs from autocast's by bf16 rounding (tests/test_compute_weights.py). So each call of
the head reads the copy through a node of its own (``_OneUse``) whose gradient is added to the
master's float32 ``.grad`` directly, as autocast's separate casts are.

Only plain float32 ``nn.Parameter`` weights of ``nn.Linear`` modules are swapped (LoRA's adapters
and a frozen float32 base layer included, the latter without a gradient); norms, embeddings and
quantized weights (bitsandbytes' parameters are ``nn.Parameter`` subclasses) stay as they are.
"""

from __future__ import annotations

from functools import partial
from types import TracebackType

import torch
from torch import Tensor, nn

from tandem_lit.rollout.weights import plain_model


def _add_to_master(master: nn.Parameter, grad: Tensor | None) -> None:
    """``grad`` (a copy's, bf16) added to the master's float32 ``.grad``."""
    if grad is None:
        return
    if master.grad is None:
        master.grad = grad.to(master.dtype)
    else:
        master.grad.add_(grad)


def _accumulate_into(master: nn.Parameter, copy: Tensor) -> None:
    """The copy's gradient, just accumulated, added to the master's ``.grad`` (float32) and dropped."""
    grad, copy.grad = copy.grad, None
    _add_to_master(master, grad)


class _OneUse(torch.autograd.Function):
    """One call's view of a copy: its gradient goes to the float32 master on its own, not summed
    in bf16 with the other calls' (the module docstring)."""

    @staticmethod
    def forward(ctx, copy: Tensor, master: tuple[nn.Parameter]) -> Tensor:  # (a tuple: not an autograd input)
        ctx.master = master[0]
        return copy.view_as(copy)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[None, None]:
        _add_to_master(ctx.master, grad)
        return None, None


class ComputeWeights:
    """Context manager: inside it, ``model``'s float32 ``nn.Linear`` weights are ``dtype`` copies
    whose gradients land in the float32 masters' ``.grad``; on exit the masters are back in place.
    A no-op for ``dtype`` None or float32 (no autocast: nothing is cast)."""

    def __init__(self, model: nn.Module, dtype: torch.dtype | None) -> None:
        self.model, self.dtype = model, dtype
        self.swapped: list[tuple[nn.Module, str, nn.Parameter]] = []
        self.hooks: list[torch.utils.hooks.RemovableHandle] = []

    def __enter__(self) -> ComputeWeights:
        if self.dtype is None or self.dtype == torch.float32:
            return self
        copies: dict[int, nn.Parameter] = {}  # by master: a weight two layers share stays shared
        with torch.no_grad():
            for module in self.model.modules():
                if not isinstance(module, nn.Linear):
                    continue
                for name, master in list(module._parameters.items()):
                    if master is None or type(master) is not nn.Parameter or master.dtype != torch.float32:
                        continue
                    copy = copies.get(id(master))
                    if copy is None:
                        copy = nn.Parameter(master.detach().to(self.dtype), requires_grad=master.requires_grad)
                        if master.requires_grad:
                            copy.register_post_accumulate_grad_hook(partial(_accumulate_into, master))
                        copies[id(master)] = copy
                    module._parameters[name] = copy
                    self.swapped.append((module, name, master))
        head = plain_model(self.model).get_output_embeddings()
        master = next((m for module, name, m in self.swapped if module is head and name == "weight"), None)
        if master is not None and master.requires_grad:
            self._one_use_per_call(head, head._parameters["weight"], master)
        return self

    def _one_use_per_call(self, head: nn.Module, copy: nn.Parameter, master: nn.Parameter) -> None:
        """Each call of ``head`` reads its weight's ``copy`` through its own ``_OneUse`` node; between
        calls (the fused head reads ``head.weight`` directly) the copy itself is in place."""

        def before(module: nn.Module, args: tuple) -> None:
            module._parameters["weight"] = _OneUse.apply(copy, (master,))

        def after(module: nn.Module, args: tuple, output: Tensor) -> None:
            module._parameters["weight"] = copy

        self.hooks += [head.register_forward_pre_hook(before), head.register_forward_hook(after)]

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None) -> None:
        for hook in self.hooks:
            hook.remove()
        for module, name, master in reversed(self.swapped):
            module._parameters[name] = master
        self.swapped, self.hooks = [], []


def autocast_dtype(device: torch.device) -> torch.dtype | None:
    """The dtype autocast computes matmuls in on ``device`` now (None: autocast is off)."""
    return torch.get_autocast_dtype(device.type) if torch.is_autocast_enabled(device.type) else None
