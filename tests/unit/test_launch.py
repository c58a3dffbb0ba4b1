"""The launcher's reading of torchrun/srun environments, SLURM's compressed lists, and its errors."""

import pytest

from megatron_jetrl.config import ConfigError
from megatron_jetrl.launch import (
    BACKEND_DEFAULTS,
    PORT_BASE,
    PORT_SPAN,
    LaunchError,
    apply_env,
    check_parallel_layout,
    detect,
    expand_nodelist,
    expand_tasks_per_node,
)
from megatron_jetrl.models import ParallelLayout


def srun_env(**over):
    """What srun gives task 11 of a 2-node x 8-task step (the variables the launcher reads)."""
    env = {"SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0", "SLURM_PROCID": "11", "SLURM_LOCALID": "3",
           "SLURM_NODEID": "1", "SLURM_NTASKS": "16", "SLURM_STEP_NUM_TASKS": "16",
           "SLURM_STEP_NODELIST": "gpu[07-08]", "SLURM_JOB_NODELIST": "gpu[07-08]",
           "SLURM_STEP_TASKS_PER_NODE": "8(x2)", "SLURM_TASKS_PER_NODE": "8(x2)"}
    env.update(over)
    return {k: v for k, v in env.items() if v is not None}


def test_nodelist_expansion():
    assert expand_nodelist("gpu[001-003,007],login1") == ["gpu001", "gpu002", "gpu003", "gpu007", "login1"]
    assert expand_nodelist("n1") == ["n1"]
    assert expand_nodelist("rack[1-2]-n[08-09]") == ["rack1-n08", "rack1-n09", "rack2-n08", "rack2-n09"]
    assert expand_nodelist("a[9-11]") == ["a9", "a10", "a11"]
    assert expand_nodelist("node-a.cluster,node-b.cluster") == ["node-a.cluster", "node-b.cluster"]


@pytest.mark.parametrize("bad", ["gpu[01-03", "gpu01-03]", "gpu[a-b]", "gpu[3-1]", "", "gpu[1-2]]x", "a b"])
def test_unparseable_nodelist_names_the_variable(bad):
    with pytest.raises(LaunchError, match="SLURM_STEP_NODELIST"):
        expand_nodelist(bad, "SLURM_STEP_NODELIST")


def test_tasks_per_node_expansion():
    assert expand_tasks_per_node("8(x4),4") == [8, 8, 8, 8, 4]
    assert expand_tasks_per_node("2") == [2]
    with pytest.raises(LaunchError, match="SLURM_TASKS_PER_NODE"):
        expand_tasks_per_node("8x4")


def test_srun_placement():
    p = detect(srun_env())
    assert (p.launcher, p.rank, p.world_size, p.local_rank, p.local_world_size, p.node_rank, p.num_nodes) == \
        ("srun", 11, 16, 3, 8, 1, 2)
    assert p.master_addr == "gpu07"
    assert p.master_port == PORT_BASE + 4242 % PORT_SPAN
    env = p.torch_env()
    assert env["RANK"] == "11" and env["WORLD_SIZE"] == "16" and env["LOCAL_RANK"] == "3"
    assert env["MASTER_ADDR"] == "gpu07" and env["MASTER_PORT"] == str(p.master_port)
    assert detect(srun_env(MASTER_PORT="31000", MASTER_ADDR="10.0.0.1")).master_port == 31000
    assert detect(srun_env(SLURM_RESTART_COUNT="2")).restart_count == 2
    assert "restart 2" in detect(srun_env(SLURM_RESTART_COUNT="2")).describe()


def test_srun_falls_back_to_job_variables():
    p = detect(srun_env(SLURM_STEP_NUM_TASKS=None, SLURM_STEP_NODELIST=None, SLURM_STEP_TASKS_PER_NODE=None))
    assert (p.world_size, p.master_addr, p.local_world_size) == (16, "gpu07", 8)


@pytest.mark.parametrize("missing", ["SLURM_PROCID", "SLURM_LOCALID", "SLURM_NODEID", "SLURM_JOB_ID"])
def test_srun_missing_variable_is_named(missing):
    env = srun_env(**{missing: None})
    if missing == "SLURM_PROCID":  # without a task id it is not an srun task: the batch-shell check applies
        with pytest.raises(LaunchError, match="srun jetrl train"):
            detect(env)
        return
    with pytest.raises(LaunchError, match=missing):
        detect(env)


def test_srun_uneven_tasks_and_bad_values():
    with pytest.raises(LaunchError, match="same number of tasks"):
        detect(srun_env(SLURM_STEP_TASKS_PER_NODE="8,4", SLURM_STEP_NUM_TASKS="12", SLURM_PROCID="3"))
    with pytest.raises(LaunchError, match="lists 3 nodes"):
        detect(srun_env(SLURM_STEP_TASKS_PER_NODE="8(x3)"))
    with pytest.raises(LaunchError, match="SLURM_PROCID.*integer"):
        detect(srun_env(SLURM_PROCID="eleven"))
    with pytest.raises(LaunchError, match="RANK"):
        detect(srun_env(SLURM_PROCID="16"))
    with pytest.raises(LaunchError, match="WORLD_SIZE.*nodes x processes per node"):
        detect(srun_env(SLURM_STEP_NUM_TASKS="12"))
    with pytest.raises(LaunchError, match="MASTER_PORT"):
        detect(srun_env(SLURM_JOB_ID="4242_7"))


def test_batch_shell_without_srun_is_refused():
    env = {"SLURM_JOB_ID": "9", "SLURM_NTASKS": "16", "SLURM_PROCID": "0", "SLURM_JOB_NODELIST": "gpu[1-2]"}
    with pytest.raises(LaunchError, match="srun jetrl train"):
        detect(env)
    single = detect({"SLURM_JOB_ID": "9", "SLURM_NTASKS": "1"})  # a one-task allocation is a single process
    assert (single.launcher, single.world_size, single.job_id) == ("single", 1, "9")


def test_torchrun_placement_wins_over_slurm():
    env = srun_env(RANK="5", WORLD_SIZE="16", LOCAL_RANK="5", LOCAL_WORLD_SIZE="8", GROUP_RANK="0",
                   MASTER_ADDR="head", MASTER_PORT="29500")
    p = detect(env)
    assert (p.launcher, p.rank, p.local_rank, p.node_rank, p.num_nodes, p.master_addr) == \
        ("torchrun", 5, 5, 0, 2, "head")
    with pytest.raises(LaunchError, match="MASTER_ADDR"):
        detect({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_PORT": "1"})
    with pytest.raises(LaunchError, match="LOCAL_WORLD_SIZE"):
        detect({"RANK": "0", "WORLD_SIZE": "6", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "4", "MASTER_ADDR": "h",
                "MASTER_PORT": "1"})


@pytest.mark.parametrize("name, value", [("WORLD_SIZE", "0"), ("LOCAL_WORLD_SIZE", "0"), ("LOCAL_WORLD_SIZE", "-2"),
                                         ("WORLD_SIZE", "two")])
def test_torchrun_sizes_below_one_are_named_not_divided_by(name, value):
    env = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "h", "MASTER_PORT": "1", name: value}
    with pytest.raises(LaunchError) as e:
        detect(env)
    assert str(e.value) == f"environment:{name}: got {value!r}; must be an integer >= 1"


def test_srun_task_count_below_one_is_named():
    with pytest.raises(LaunchError, match="^environment:SLURM_NTASKS: got '0'; must be an integer >= 1$"):
        detect(srun_env(SLURM_STEP_NUM_TASKS=None, SLURM_NTASKS="0"))


def test_plain_start_is_a_world_of_one():
    p = detect({})
    assert (p.launcher, p.rank, p.world_size, p.master_addr) == ("single", 0, 1, "127.0.0.1")
    assert 0 < p.master_port < 65536


def test_tp_groups_stay_inside_a_node():
    check_parallel_layout(2, 8, ParallelLayout(tp=8), 4)
    with pytest.raises(ConfigError, match="actor.parallel.tp.*no TP group spans nodes"):
        check_parallel_layout(2, 6, ParallelLayout(tp=4), 2)
    with pytest.raises(ConfigError, match="rollout.vllm.tensor_parallel_size"):
        check_parallel_layout(2, 8, ParallelLayout(tp=2), 16)
    check_parallel_layout(1, 4, ParallelLayout(tp=4), 4)


def test_the_allocator_grows_segments_in_place_unless_the_job_sets_it():
    """The colocated actor and engine take turns at the whole GPU: jetrl train makes torch's allocator
    grow segments in place (no retry storms at the limit); a value the job's environment sets stays."""
    env: dict[str, str] = {}
    apply_env(env, {}, BACKEND_DEFAULTS)
    assert env["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    env = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False"}
    apply_env(env, {}, BACKEND_DEFAULTS)
    assert env["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:False"


def test_apply_env_sets_required_and_defaults_and_refuses_conflicts():
    env = {"CUDA_DEVICE_MAX_CONNECTIONS": "8"}
    changed = apply_env(env, {"VLLM_USE_DEEP_GEMM_E8M0": "0"}, {"CUDA_DEVICE_MAX_CONNECTIONS": "1", "X": "y"})
    assert env == {"CUDA_DEVICE_MAX_CONNECTIONS": "8", "VLLM_USE_DEEP_GEMM_E8M0": "0", "X": "y"}
    assert sorted(changed) == ["VLLM_USE_DEEP_GEMM_E8M0", "X"]
    assert apply_env(env, {"VLLM_USE_DEEP_GEMM_E8M0": "0"}) == []
    with pytest.raises(LaunchError, match="VLLM_USE_DEEP_GEMM_E8M0"):
        apply_env({"VLLM_USE_DEEP_GEMM_E8M0": "1"}, {"VLLM_USE_DEEP_GEMM_E8M0": "0"})


def test_the_local_launchers_status_and_worker_variables():
    from megatron_jetrl.launch import detect
    from megatron_jetrl.launch.local import job_status, worker_env

    assert job_status([0, 0]) == 0
    assert job_status([75, 75]) == 75 and job_status([0, 75]) == 75
    assert job_status([75, 1, 2]) == 1  # a failure wins over a stop; the first one
    assert job_status([0, -9]) == 137 and job_status([0, None]) == 137  # killed, as the shell says it
    env = worker_env({"PATH": "/bin", "SLURM_JOB_ID": "5", "SLURM_PROCID": "0", "SLURM_STEP_ID": "batch"}, 1, 4, 2900)
    placement = detect(env)
    assert (placement.launcher, placement.rank, placement.world_size, placement.local_rank) == ("torchrun", 1, 4, 1)
    assert (placement.num_nodes, placement.master_port, placement.job_id) == (1, 2900, "5")
    assert "SLURM_PROCID" not in env and env["PATH"] == "/bin"
