"""The QK-norm of ``impl="cpu"``: :func:`lssar.ops.common.unit` on the fused kernel.

The eager ``unit`` is a dozen element-wise passes forward and more backward; at the tiny-cpu
model's shape (B=32 H=4 T=256 D=32) those of q and k took 20 ms of a call whose SDPA softmax
forward+backward takes 60 ms. The kernel's ``unit_forward`` / ``unit_backward`` do one pass each
way with the same arithmetic (the row divided by its largest magnitude, then by that vector's
norm) and the same edge cases (a zero row: zeros and a zero gradient; a row holding a NaN or an
infinity: unit's values and a NaN gradient). Where the kernel cannot be built, an eager call runs
``unit`` itself (the results of ``impl="chunked"``, bit for bit); a compiled one, which cannot ask
for the kernel outside the ops (torch.compile does not trace its lookup), gets the ops' torch
arithmetic.
"""

from __future__ import annotations

import torch
from torch import Tensor

from lssar.ops.common import compute_dtype, unit


@torch.library.custom_op("lssar::unit_cpu", mutates_args=())
def unit_cpu_op(x: Tensor) -> tuple[Tensor, Tensor]:
    """``x (..., D)`` float32 on CPU -> ``(x / ||x||, 1 / ||x||)``, shaped ``(..., D)`` and
    ``(...)``: the second is 0 on zero rows and NaN on rows holding a NaN or an infinity."""
    from lssar.ops.cpu.build import kernel

    mod = kernel()
    if mod is None:  # unit itself, and 1 / (||x / big|| big) as the kernel keeps it
        big = x.abs().amax(-1)
        norm = torch.linalg.vector_norm(x / big.unsqueeze(-1), dim=-1)
        return unit(x), torch.where(big == 0, 0.0, 1 / norm / big)
    y, inv = mod.unit_forward(x.reshape(-1, x.shape[-1]).contiguous())
    return y.reshape(x.shape), inv.reshape(x.shape[:-1])


@unit_cpu_op.register_fake
def _unit_cpu_fake(x):
    return x.new_empty(x.shape), x.new_empty(x.shape[:-1])


@torch.library.custom_op("lssar::unit_cpu_backward", mutates_args=())
def unit_cpu_backward_op(grad: Tensor, y: Tensor, inv: Tensor) -> Tensor:
    """The gradient of :func:`unit_cpu_op` (``grad``, ``y``: ``(..., D)``; ``inv``: ``(...)``)."""
    from lssar.ops.cpu.build import kernel

    mod = kernel()
    if mod is None:
        dx = (grad - y * (y * grad).sum(-1, keepdim=True)) * inv.unsqueeze(-1)
        return torch.where(inv.unsqueeze(-1) == 0, 0.0, dx)
    d = y.shape[-1]
    flat = [t.reshape(-1, d).contiguous() for t in (grad, y)]
    return mod.unit_backward(*flat, inv.reshape(-1).contiguous()).reshape(y.shape)


@unit_cpu_backward_op.register_fake
def _unit_cpu_backward_fake(grad, y, inv):
    return y.new_empty(y.shape)


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(*output)


def _backward(ctx, grad, _grad_inv):
    return unit_cpu_backward_op(grad, *ctx.saved_tensors)


unit_cpu_op.register_autograd(_backward, setup_context=_setup_context)


def _no_double_backward(ctx, *grads):
    raise RuntimeError(
        "impl='cpu' has no double backward (its QK-norm and attention backward are closed-form "
        "kernels); for second-order gradients call lssar.attention(..., impl='reference')"
    )


unit_cpu_backward_op.register_autograd(
    _no_double_backward, setup_context=lambda ctx, inputs, output: None
)


def unit_cpu(x: Tensor) -> Tensor:
    """:func:`lssar.ops.common.unit` (``x (..., D)`` -> ``(..., D)``): on the fused kernel for
    float32 compute on CPU (bf16 / fp16 inputs are upcast first, as ``unit`` does), else ``unit``
    itself."""
    xc = x.to(compute_dtype(x.dtype))
    if xc.dtype != torch.float32 or xc.device.type != "cpu" or xc.shape[-1] == 0:
        return unit(xc)
    if not torch.compiler.is_compiling():
        from lssar.ops.cpu.build import kernel

        if kernel() is None:
            return unit(xc)
    return unit_cpu_op(xc)[0]


def unit_no_grad(x: Tensor) -> Tensor:
    """:func:`unit_cpu` without its op's dispatch, for calls that record no gradient (a decode
    step's few queries, where the dispatch cost more than the arithmetic); eager only (the kernel
    lookup is not traced)."""
    xc = x.to(compute_dtype(x.dtype))
    if xc.dtype != torch.float32 or xc.device.type != "cpu" or xc.shape[-1] == 0:
        return unit(xc)
    from lssar.ops.cpu.build import kernel

    mod = kernel()
    if mod is None:
        return unit(xc)
    return mod.unit_forward(xc.reshape(-1, xc.shape[-1]).contiguous())[0].reshape(xc.shape)
