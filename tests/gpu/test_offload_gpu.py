"""The actor's offload (``actor/offload.py``) on a GPU, at sizes where the caching allocator gives
each tensor its own segment (64 MiB), so device memory frees as the storages go: with a need, only
the gradients (dropped, no copy) and then as much optimizer state as the need asks for leave the GPU;
everything comes back byte for byte (the dropped group as zeros)."""

import pytest
import torch

from megatron_jetrl.actor.offload import DeviceMemory

pytestmark = pytest.mark.gpu

MIB = 2**20


def _tensors(n: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    return [torch.randint(0, 255, (64 * MIB,), dtype=torch.uint8, device="cuda", generator=g) for _ in range(n)]


@pytest.fixture
def groups():
    torch.cuda.empty_cache()
    state = {"grads": _tensors(2, 0), "optimizer": _tensors(4, 1), "params": _tensors(2, 2)}
    yield state
    del state
    torch.cuda.empty_cache()


def _offload(groups, need):
    memory = DeviceMemory()
    before = {k: [t.clone().cpu() for t in ts] for k, ts in groups.items()}
    released = memory.offload({"grads": (groups["grads"], False), "optimizer": (groups["optimizer"], True),
                               "params": (groups["params"], True)}, need=need)
    free = torch.cuda.mem_get_info()[0]
    memory.restore()
    for name, ts in groups.items():
        for t, b in zip(ts, before[name], strict=True):
            expected = torch.zeros_like(b) if name == "grads" and released["grads"] else b
            assert torch.equal(t.cpu(), expected), name
    return released, free


def test_a_need_the_gpu_already_has_moves_nothing(groups):
    released, _ = _offload(groups, need=0)
    assert released == {"grads": 0, "optimizer": 0, "params": 0}


def test_a_need_moves_gradients_then_optimizer_state_only_that_far(groups):
    need = torch.cuda.mem_get_info()[0] + 2 * 64 * MIB + 2 * 64 * MIB - MIB
    released, free = _offload(groups, need)
    assert free >= need
    assert released == {"grads": 2 * 64 * MIB, "optimizer": 2 * 64 * MIB, "params": 0}, released


def test_without_a_need_everything_moves(groups):
    released, _ = _offload(groups, None)
    assert released == {"grads": 2 * 64 * MIB, "optimizer": 4 * 64 * MIB, "params": 2 * 64 * MIB}
