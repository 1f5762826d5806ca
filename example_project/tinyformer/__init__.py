"""tinyformer: a one-block decoder-only transformer, small enough to torch.compile in seconds on a CPU."""

from .kernels import bias_gelu_reference, fused_bias_gelu, triton_bias_gelu_available
from .model import TinyConfig, TinyFormer, lm_loss, make_batch, make_optimizer, train_step

__all__ = [
    "TinyConfig",
    "TinyFormer",
    "bias_gelu_reference",
    "fused_bias_gelu",
    "lm_loss",
    "make_batch",
    "make_optimizer",
    "train_step",
    "triton_bias_gelu_available",
]
