"""The same checks on CUDA (Inductor's Triton backend), plus max-autotune. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch
from helpers import check_dynamic_seq_len, check_inference, check_train_steps

pytestmark = pytest.mark.gpu


def test_gpu_compiled_inference_matches_eager(cuda: torch.device) -> None:
    check_inference(cuda)


def test_gpu_compiled_train_step_matches_eager(cuda: torch.device) -> None:
    check_train_steps(cuda)


def test_gpu_dynamic_sequence_length_compiles_once(cuda: torch.device) -> None:
    check_dynamic_seq_len(cuda)


def test_gpu_max_autotune_inference_matches_eager(cuda: torch.device) -> None:
    # Autotuned matmul templates may pick TF32 or a different reduction order: compare a bit looser.
    check_inference(cuda, tol=2e-3, mode="max-autotune-no-cudagraphs")
