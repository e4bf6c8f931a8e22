"""GPU checks of the quantized exchange and DiLoCo's device handling (``-m gpu``;
skipped without CUDA). Single-device: what must hold on a GPU regardless of NCCL."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from rallypoint.integrations.local_sgd import DiLoCo
from rallypoint.process_groups.quantization import dequantize_rowwise, quantize_rowwise
from rallypoint.process_groups.work import CompletedWork

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantization_on_cuda_matches_cpu(dtype: torch.dtype) -> None:
    """The same bytes on both devices, so GPU and CPU replicas would agree."""
    x = torch.randn(5000, generator=torch.Generator().manual_seed(0)).to(dtype)
    q_cpu, s_cpu = quantize_rowwise(x)
    q_gpu, s_gpu = quantize_rowwise(x.cuda())
    assert torch.equal(q_gpu.cpu(), q_cpu) and torch.equal(s_gpu.cpu(), s_cpu)
    back = dequantize_rowwise(q_gpu, s_gpu, x.numel(), dtype)
    assert back.device.type == "cuda"
    assert torch.equal(back.cpu(), dequantize_rowwise(q_cpu, s_cpu, x.numel(), dtype))


class _OneReplica:
    """A manager of a quorum of one: every allreduce is already the mean."""

    _use_async_quorum = False

    def __init__(self) -> None:
        self.step = 0
        self.registered: dict[str, Any] = {}

    def register_state_dict_fn(self, key: str, load: Any, save: Any) -> None:
        self.registered[key] = (load, save)

    def start_quorum(self) -> None:
        pass

    def allreduce(self, t: torch.Tensor, should_quantize: bool = False, reduce_op: Any = None) -> Any:
        return CompletedWork(t)

    def should_commit(self) -> bool:
        self.step += 1
        return True

    def current_step(self) -> int:
        return self.step


def test_diloco_keeps_a_pinned_cpu_backup_of_a_cuda_model() -> None:
    """The global parameters live in pinned host memory by default; a sync brings the
    CUDA model back to them (outer SGD with lr 1 and alpha 0: global := local mean)."""
    torch.manual_seed(0)
    model = nn.Linear(8, 4).cuda()
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    outer = torch.optim.SGD(model.parameters(), lr=1.0)
    m = _OneReplica()
    with DiLoCo(m, [model], inner, outer, sync_every=2) as d:
        backup = d._fragments[0].backup
        assert all(t.device.type == "cpu" and t.is_pinned() for t in backup.values())
        for _ in range(2):
            inner.zero_grad()
            model(torch.randn(3, 8, device="cuda")).pow(2).mean().backward()
            inner.step()
            local = [p.detach().clone() for p in model.parameters()]
    # After the sync: model == global == the local value it had reached (one replica).
    for p, want, (name, b) in zip(model.parameters(), local, backup.items()):
        assert p.device.type == "cuda"
        torch.testing.assert_close(p.detach(), want)
        torch.testing.assert_close(b.cuda(), want, msg=name)
