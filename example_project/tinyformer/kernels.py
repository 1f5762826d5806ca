"""A fused bias-add + GELU: a user Triton kernel on CUDA, plain torch everywhere else.

The Triton version is a ``torch.library.triton_op``, so ``torch.compile`` sees into the kernel (and
Inductor caches it with the rest of the graph) and autograd works through ``register_autograd``.
Triton is imported only when CUDA is available, and only if it is installed: CPU-only machines never
touch it. On CPU the eager fallback ``gelu(x + bias)`` is what Inductor fuses into one C++ loop anyway.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

_SQRT1_2 = 1.0 / math.sqrt(2.0)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)


def bias_gelu_reference(x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """The exact (erf) GELU of ``x + bias``, written out: what every implementation is checked against."""
    y = x + bias
    return 0.5 * y * (1.0 + torch.erf(y * _SQRT1_2))


def _bias_gelu_backward_math(
    x: torch.Tensor, bias: torch.Tensor, grad: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    y = (x + bias).float()
    cdf = 0.5 * (1.0 + torch.erf(y * _SQRT1_2))
    pdf = torch.exp(-0.5 * y * y) * _INV_SQRT_2PI
    grad_y = grad.float() * (cdf + y * pdf)
    grad_bias = grad_y.reshape(-1, bias.numel()).sum(0)
    return grad_y.to(x.dtype), grad_bias.to(bias.dtype)


def _build_triton_bias_gelu() -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None:
    """Define the Triton kernel and its custom op; None when Triton is not installed."""
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None
    from torch.library import triton_op, wrap_triton

    @triton.jit
    def _bias_gelu_kernel(x_ptr, bias_ptr, out_ptr, n_elements, n_cols, BLOCK: tl.constexpr):
        pid = tl.program_id(axis=0)
        offsets = pid * BLOCK + tl.arange(0, BLOCK)
        mask = offsets < n_elements
        x = tl.load(x_ptr + offsets, mask=mask).to(tl.float32)
        b = tl.load(bias_ptr + offsets % n_cols, mask=mask).to(tl.float32)
        y = x + b
        out = 0.5 * y * (1.0 + tl.erf(y * 0.7071067811865476))
        tl.store(out_ptr + offsets, out.to(out_ptr.dtype.element_ty), mask=mask)

    @triton_op("tinyformer::bias_gelu", mutates_args={})
    def bias_gelu(x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()
        out = torch.empty_like(x)
        n_elements = x.numel()

        def grid(meta: dict[str, int]) -> tuple[int]:
            return (triton.cdiv(n_elements, meta["BLOCK"]),)

        wrap_triton(_bias_gelu_kernel)[grid](x, bias, out, n_elements, bias.numel(), BLOCK=1024)
        return out

    def setup_context(ctx: torch.autograd.function.FunctionCtx, inputs: tuple[torch.Tensor, torch.Tensor],
                      output: torch.Tensor) -> None:
        ctx.save_for_backward(*inputs)

    def backward(ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x, bias = ctx.saved_tensors  # type: ignore[attr-defined]
        return _bias_gelu_backward_math(x, bias, grad)

    bias_gelu.register_autograd(backward, setup_context=setup_context)
    return bias_gelu


# Built at import, outside any compiled region, and only where a GPU could run it.
_TRITON_BIAS_GELU = _build_triton_bias_gelu() if torch.cuda.is_available() else None


def triton_bias_gelu_available() -> bool:
    """True when CUDA tensors go through the user Triton kernel."""
    return _TRITON_BIAS_GELU is not None


def fused_bias_gelu(x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """``gelu(x + bias)`` over the last dimension of ``x`` (``bias`` has that many elements)."""
    if x.is_cuda and _TRITON_BIAS_GELU is not None:
        return _TRITON_BIAS_GELU(x, bias)
    return F.gelu(x + bias)
