"""torch.compile on CPU (Inductor's C++ backend): the graphs the megacache demo caches."""

from __future__ import annotations

from helpers import check_dynamic_seq_len, check_inference, check_train_steps


def test_compiled_inference_matches_eager() -> None:
    check_inference("cpu")


def test_compiled_train_step_matches_eager() -> None:
    check_train_steps("cpu")


def test_dynamic_sequence_length_compiles_once() -> None:
    check_dynamic_seq_len("cpu")
