"""The fused bias + GELU: the eager fallback on CPU, the user Triton kernel on CUDA."""

from __future__ import annotations

import pytest
import torch
from tinyformer import bias_gelu_reference, fused_bias_gelu, triton_bias_gelu_available


def _inputs(device: torch.device | str, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    x = (3 * torch.randn(4, 16, 128, generator=gen)).to(device=device, dtype=dtype)
    bias = torch.randn(128, generator=gen).to(device=device, dtype=dtype)
    return x.requires_grad_(), bias.requires_grad_()


def _check_against_reference(device: torch.device | str, fn=fused_bias_gelu, tol: float = 1e-5) -> None:
    x, bias = _inputs(device)
    got = fn(x, bias)
    grad = torch.randn_like(got)
    got_dx, got_db = torch.autograd.grad(got, (x, bias), grad)
    ref = bias_gelu_reference(x, bias)
    ref_dx, ref_db = torch.autograd.grad(ref, (x, bias), grad)
    torch.testing.assert_close(got, ref, atol=tol, rtol=tol)
    torch.testing.assert_close(got_dx, ref_dx, atol=tol, rtol=tol)
    torch.testing.assert_close(got_db, ref_db, atol=10 * tol, rtol=tol)


def test_cpu_fallback_matches_reference() -> None:
    _check_against_reference("cpu")


def test_cpu_never_uses_triton() -> None:
    x, bias = _inputs("cpu")
    # The fallback is plain torch: autograd records torch's own GELU, not the custom op's backward.
    assert fused_bias_gelu(x, bias).grad_fn.name() == "GeluBackward0"
    if not torch.cuda.is_available():
        assert not triton_bias_gelu_available()


@pytest.mark.gpu
def test_triton_kernel_matches_reference(cuda: torch.device) -> None:
    if not triton_bias_gelu_available():
        pytest.skip("triton is not installed")
    _check_against_reference(cuda)


@pytest.mark.gpu
def test_triton_kernel_under_torch_compile(cuda: torch.device) -> None:
    if not triton_bias_gelu_available():
        pytest.skip("triton is not installed")
    _check_against_reference(cuda, fn=torch.compile(fused_bias_gelu))


@pytest.mark.gpu
def test_triton_kernel_half_precision(cuda: torch.device) -> None:
    if not triton_bias_gelu_available():
        pytest.skip("triton is not installed")
    x, bias = _inputs(cuda, torch.bfloat16)
    torch.testing.assert_close(fused_bias_gelu(x, bias), bias_gelu_reference(x.float(), bias.float()).bfloat16(),
                               atol=2e-2, rtol=2e-2)
