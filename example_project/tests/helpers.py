"""Checks shared by the CPU and GPU tests: compiled tinyformer against eager tinyformer."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
from tinyformer import TinyConfig, TinyFormer, make_batch, make_optimizer, train_step

CFG = TinyConfig()  # vocab 64, d_model 32, 2 heads, seq 16


def model_on(device: torch.device | str) -> TinyFormer:
    torch.manual_seed(0)
    return TinyFormer(CFG).to(device)


def check_inference(device: torch.device | str, tol: float = 1e-4, **compile_kwargs: Any) -> None:
    model = model_on(device).eval()
    compiled = torch.compile(model, **compile_kwargs)
    tokens, _ = make_batch(CFG, batch_size=4, device=device)
    with torch.no_grad():
        expected = model(tokens)
        got = compiled(tokens)
    assert got.shape == (4, CFG.max_seq_len, CFG.vocab_size)
    torch.testing.assert_close(got, expected, atol=tol, rtol=tol)


def check_train_steps(device: torch.device | str, steps: int = 3, tol: float = 1e-4) -> None:
    """The compiled train step (forward, backward, AdamW step) tracks the eager one step for step."""
    eager_model = model_on(device).train()
    compiled_model = copy.deepcopy(eager_model)
    eager_opt, compiled_opt = make_optimizer(eager_model), make_optimizer(compiled_model)
    compiled_step: Callable[..., torch.Tensor] = torch.compile(train_step)
    losses = []
    for i in range(steps):
        batch = make_batch(CFG, batch_size=4, seed=i, device=device)
        expected = train_step(eager_model, eager_opt, batch)
        got = compiled_step(compiled_model, compiled_opt, batch)
        torch.testing.assert_close(got, expected, atol=tol, rtol=tol)
        losses.append(float(got))
    for p_compiled, p_eager in zip(compiled_model.parameters(), eager_model.parameters(), strict=True):
        torch.testing.assert_close(p_compiled, p_eager, atol=tol, rtol=tol)
    assert losses[-1] < losses[0], f"training did not reduce the loss: {losses}"


def check_dynamic_seq_len(device: torch.device | str, tol: float = 1e-4) -> None:
    """One graph serves two sequence lengths: the second call must not recompile."""
    model = model_on(device).eval()
    compiled = torch.compile(model, dynamic=True)
    with torch.no_grad():
        for i, seq_len in enumerate((CFG.max_seq_len // 2, CFG.max_seq_len)):
            tokens, _ = make_batch(CFG, batch_size=2, seq_len=seq_len, device=device)
            expected = model(tokens)
            if i == 0:
                got = compiled(tokens)
            else:
                with torch.compiler.set_stance("fail_on_recompile"):
                    got = compiled(tokens)
            assert got.shape == (2, seq_len, CFG.vocab_size)
            torch.testing.assert_close(got, expected, atol=tol, rtol=tol)
