"""The exact engine keeps vLLM's batch-invariant NCCL settings from outliving its start
(rollout/vllm_exact.py): every pinned variable gets its job value back, and NCCL is started with the
job's settings first. (vLLM's own override inside the guard: tests/contract/test_vllm_exact.py; on a
GPU, after a real engine start: tests/gpu/test_exact.py.)"""

import os

import pytest

from megatron_jetrl.rollout import vllm_exact


@pytest.fixture
def environ(monkeypatch):
    """os.environ as it was, back after the test."""
    saved = dict(os.environ)
    yield os.environ
    os.environ.clear()
    os.environ.update(saved)


def test_every_pinned_variable_gets_its_job_value_back(environ):
    environ.pop("NCCL_MAX_NCHANNELS", None)
    environ["NCCL_PROTO"] = "LL128"
    environ["NCCL_ALGO"] = "ring"
    environ["NCCL_GRAPH_REGISTER"] = "0"
    with vllm_exact.job_nccl_environment() as undone:
        environ["NCCL_MAX_NCHANNELS"] = "1"  # set where the job had nothing
        environ["NCCL_PROTO"] = "Simple"  # changed
        environ.pop("NCCL_ALGO")  # removed
        environ["NCCL_GRAPH_REGISTER"] = "1"  # not a pin: vLLM's own business, left as it is
        assert undone == {}
    assert "NCCL_MAX_NCHANNELS" not in environ
    assert environ["NCCL_PROTO"] == "LL128" and environ["NCCL_ALGO"] == "ring"
    assert environ["NCCL_GRAPH_REGISTER"] == "1"
    assert undone == {"NCCL_MAX_NCHANNELS": "1", "NCCL_PROTO": "Simple", "NCCL_ALGO": None}


def test_the_job_values_come_back_when_the_start_fails(environ):
    environ["NCCL_NTHREADS"] = "256"
    with pytest.raises(RuntimeError), vllm_exact.job_nccl_environment():
        environ["NCCL_NTHREADS"] = "1"
        raise RuntimeError("engine start failed")
    assert environ["NCCL_NTHREADS"] == "256"


def test_nothing_pinned_nothing_undone(environ):
    with vllm_exact.job_nccl_environment() as undone:
        pass
    assert undone == {}


class FakeDist:
    def __init__(self, backend="nccl", world=2, initialized=True):
        self.backend, self.world, self.initialized, self.barriers = backend, world, initialized, []

    def is_available(self):
        return True

    def is_initialized(self):
        return self.initialized

    def get_world_size(self):
        return self.world

    def get_backend(self):
        return self.backend

    def barrier(self, device_ids=None):
        self.barriers.append(device_ids)


@pytest.mark.parametrize("fake, barriers", [(FakeDist(), 1), (FakeDist(world=1), 0), (FakeDist(backend="gloo"), 0),
                                            (FakeDist(initialized=False), 0)])
def test_nccl_starts_with_the_jobs_settings_where_the_job_has_an_nccl_world(fake, barriers, monkeypatch):
    import torch
    import torch.distributed

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    for name in ("is_available", "is_initialized", "get_world_size", "get_backend", "barrier"):
        monkeypatch.setattr(torch.distributed, name, getattr(fake, name))
    vllm_exact.initialize_nccl()
    assert fake.barriers == [[3]] * barriers
