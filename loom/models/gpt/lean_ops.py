"""The decoder block's elementwise pieces as autograd Functions that keep only what their backward
needs, in the compute dtype (issue 26): RMSNorm keeps its input and the fp32 rstd [tokens, 1];
RoPE keeps nothing but the table (its backward is the inverse rotation); SwiGLU keeps gate and up,
and fused with the down projection (swiglu_down) not even their product, w2's input.

Each works on plain tensors and on DTensors (the norms under sequence parallel): the ops inside
dispatch through DTensor like any other, and reductions over the sequence leave the weight's
gradient Partial, as autograd's own mul backward does. No new collectives.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from loom.parallel.backward_pass import takes_inputs, takes_weights

# Plain autograd ops instead of the Functions that take a parameter (RMSNorm, SwiGLU-down): the same
# math, with autograd's saved tensors. For a zero-bubble pipeline on a torch whose weight pass cannot
# start at a Python Function (loom/parallel/pipeline.py: weight_pass_takes_functions); set per run.
_plain = False


def use_plain_ops(plain: bool) -> None:
    global _plain
    _plain = plain


def plain_ops() -> bool:
    return _plain


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps, out_dtype):
        # Statistics in fp32 for stability under 16-bit compute; the product in x's dtype, as before.
        xf = x.float()
        rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        out = (xf * rstd).type_as(x) * weight
        ctx.save_for_backward(x, weight, rstd)
        # Under autocast the linears read a 16-bit copy anyway: one cast here instead of one per linear.
        return out if out_dtype is None else out.to(out_dtype)

    @staticmethod
    def backward(ctx, grad):
        x, weight, rstd = ctx.saved_tensors
        xhat = x.float() * rstd
        g = grad.float()
        grad_x = grad_w = None
        if takes_weights():  # the weight saw the normalized tensor rounded to x's dtype (forward's type_as)
            grad_w = (g * xhat.type_as(x).float()).sum(dim=tuple(range(g.ndim - 1))).to(weight.dtype)
        if takes_inputs():
            gn = g * weight.float()
            grad_x = (rstd * (gn - xhat * (gn * xhat).mean(-1, keepdim=True))).to(x.dtype)
        return grad_x, grad_w, None, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    out_dtype = None
    device = x.device.type
    if torch.is_autocast_enabled(device) and x.dtype == torch.float32:
        out_dtype = torch.get_autocast_dtype(device)
    if _plain:
        xf = x.float()
        out = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).type_as(x) * weight
        return out if out_dtype is None else out.to(out_dtype)
    return _RMSNorm.apply(x, weight, eps, out_dtype)


def _rotate(x: torch.Tensor, rope: torch.Tensor, sign: float) -> torch.Tensor:
    # fp32 for the rotation (angles of far positions lose precision in bf16), then back.
    xf = x.float().unflatten(-1, (-1, 2))
    x_even, x_odd = xf[..., 0], xf[..., 1]
    # rope [2, T, D/2] for every sequence alike, or [2, B, T, D/2] (documents: positions per sequence)
    cos, sin = (r.float()[None, :, None, :] if r.dim() == 2 else r.float()[:, :, None, :] for r in rope)
    sin = sin * sign
    rotated = torch.stack([x_even * cos - x_odd * sin, x_even * sin + x_odd * cos], dim=-1)
    rotated = rotated.flatten(-2)
    # Cast only when x is not fp32: under torch.compile, torch 2.11 loses the gradient of a Function
    # whose forward returns a no-op `.to` of its result (wq and wk trained on zeros in fp32).
    return rotated if rotated.dtype == x.dtype else rotated.to(x.dtype)


class _Rope(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, rope):
        ctx.save_for_backward(rope)  # the shared table (or FSDP2's 16-bit cast of it), not a copy
        return _rotate(x, rope, 1.0)

    @staticmethod
    def backward(ctx, grad):
        (rope,) = ctx.saved_tensors
        return _rotate(grad, rope, -1.0), None  # a rotation's transpose is its inverse


def apply_rope(x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """Rotate (even, odd) pairs of x [B, T, H, D] by the angles in rope [2, T, D//2] (or [2, B, T, D//2])."""
    return _Rope.apply(x, rope)


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up):
        ctx.save_for_backward(gate, up)
        return F.silu(gate) * up

    @staticmethod
    def backward(ctx, grad):
        gate, up = ctx.saved_tensors
        # silu(gate) recomputed: one f-wide pass instead of keeping it. The same kernels (and so
        # the same rounding) as autograd's own backward of silu(gate) * up, with two f-wide tensors of
        # its own beside `grad` (the gradients; silu's backward in place), not three.
        grad_up = F.silu(gate).mul_(grad)
        grad_gate = grad * up
        return torch.ops.aten.silu_backward.grad_input(grad_gate, gate, grad_input=grad_gate), grad_up


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up, keeping gate and up for backward (not silu(gate) too)."""
    return _SwiGLU.apply(gate, up)


class _SwiGLUDown(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up, weight):
        # The matmul in gate's dtype, as autocast's linear runs it; autocast's own cast would be cached
        # and kept for backward, this one is dropped after the matmul (backward casts again).
        with torch.autocast(gate.device.type, enabled=False):
            out = F.linear(F.silu(gate).mul_(up), weight.to(gate.dtype))  # one f-wide temporary
        ctx.save_for_backward(gate, up, weight)  # the weight is the parameter itself: no bytes of its own
        return out

    @staticmethod
    def backward(ctx, grad):
        gate, up, weight = ctx.saved_tensors
        with torch.autocast(grad.device.type, enabled=False):
            # At most two f-wide tensors of its own live at once (autograd's backward of the unfused
            # product holds three): w2's input recomputed and dropped after the weight's gradient, then
            # silu(gate) again (one f-wide pass more) and every other step in place.
            grad_w = grad_gate = grad_up = None
            if takes_weights():
                product = F.silu(gate).mul_(up)
                # As mm's backward computes it for nn.Linear's transposed weight: grad^T · input,
                # contiguous (the same kernel, so the same rounding; no copy into the parameter's layout).
                grad_w = grad.flatten(0, -2).t().mm(product.flatten(0, -2)).to(weight.dtype)
                del product
            if takes_inputs():
                grad_gate, grad_up = _swiglu_grads(gate, up, grad.matmul(weight.to(grad.dtype)))
            return grad_gate, grad_up, grad_w


def _swiglu_grads(gate: torch.Tensor, up: torch.Tensor, grad_product: torch.Tensor) -> tuple:
    """(gate's, up's gradient) of silu(gate) * up from the product's gradient, which becomes gate's in
    place: silu(gate) recomputed, one f-wide tensor of its own."""
    grad_up = F.silu(gate).mul_(grad_product)
    grad_product.mul_(up)
    return torch.ops.aten.silu_backward.grad_input(grad_product, gate, grad_input=grad_product), grad_up


class _GroupedSwiGLUDown(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up, weight, ends):
        out = torch._grouped_mm(F.silu(gate).mul_(up), weight.transpose(-2, -1), offs=ends)
        ctx.save_for_backward(gate, up, weight, ends)
        return out

    @staticmethod
    def backward(ctx, grad):
        gate, up, weight, ends = ctx.saved_tensors
        grad = grad.contiguous()
        # The two grouped GEMMs, in the layouts, that _grouped_mm's own backward runs (torch 2.11 and
        # 2.13 alike: what CUDA's kernel takes), w2's input recomputed for the first and dropped.
        grad_w = grad_gate = grad_up = None
        if takes_weights():
            product = F.silu(gate).mul_(up)
            grad_w = torch._grouped_mm(grad.t(), product, offs=ends)  # [E, d, hidden], the weight's layout
            del product
        if takes_inputs():
            grad_gate, grad_up = _swiglu_grads(gate, up, torch._grouped_mm(grad, weight, offs=ends))
        return grad_gate, grad_up, grad_w, None


def grouped_swiglu_down(gate: torch.Tensor, up: torch.Tensor, weight: torch.Tensor,
                        ends: torch.Tensor) -> torch.Tensor:
    """The experts' swiglu_down as one grouped GEMM (rows [L, hidden] grouped by `ends`, weight
    [E, d, hidden] in the rows' dtype): keeps gate, up and the weight, not w2's input."""
    if _plain:
        return torch._grouped_mm(F.silu(gate) * up, weight.transpose(-2, -1), offs=ends)
    return _GroupedSwiGLUDown.apply(gate, up, weight, ends)


def swiglu_down(gate: torch.Tensor, up: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """F.linear(silu(gate) * up, weight), keeping gate, up and the weight for backward: not the
    product (w2's input) nor, under autocast, a 16-bit copy of the weight. Plain tensors only: under
    tensor parallel w2 is row-parallel (a DTensor laid out by its module's hooks) and goes through
    swiglu and its module instead."""
    if _plain:
        with torch.autocast(gate.device.type, enabled=False):
            return F.linear(F.silu(gate) * up, weight.to(gate.dtype))
    return _SwiGLUDown.apply(gate, up, weight)
