"""A TorchTitan config registry for the CPU run (``--module tests.titan.cpu_config``).

TorchTitan's own ``llama3_torchft_debugmodel`` (torchtitan.experiments.torchft.llama3),
unchanged but for what a CPU needs: its model with the ``varlen`` attention backend (its
default, FlexAttention, has no backward on CPU; tests/titan/launch.py computes varlen_attn on
CPU). The same registry function, the same
model, optimizer, FT options otherwise; the test sets the rest on the command line as a user
would (``--training.*``, ``--fault_tolerance.*``).
"""

from __future__ import annotations

from torchtitan.experiments.torchft.llama3 import model_registry
from torchtitan.experiments.torchft.llama3.config_registry import llama3_torchft_debugmodel
from torchtitan.experiments.torchft.trainer import FaultTolerantTrainer


def llama3_torchft_debugmodel_cpu() -> FaultTolerantTrainer.Config:
    """TorchTitan's torchft debug config with the ``varlen`` attention backend."""
    config = llama3_torchft_debugmodel()
    config.model_spec = model_registry("debugmodel", attn_backend="varlen")
    return config
