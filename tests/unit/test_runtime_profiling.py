"""runtime/profiling.py on the CPU: the kernel classes of a profiled step, and what a profiled step
records (on a CPU device, wall seconds per phase; the kernels need a GPU, tests/gpu)."""

import json
import time

import torch

from megatron_jetrl.runtime.profiling import STEP_KERNEL_CLASSES, StepProfiler, by_class


def test_step_kernel_classes_cover_the_engine_and_the_trainer():
    names = {
        "void cutlass::device_kernel<flash::enable_sm90_or_later<flash::FlashAttnFwdSm90<": "attention",
        "nvjet_sm90_tst_256x128_64x4_2x1_v_bz_coopA_NNT": "gemm",
        "void cutlass::device_kernel<cutlass::gemm::kernel::GemmUniversal<cutlass::gemm::Mai": "gemm",
        "void jetrl::quantize_1x128_kernel<__nv_bfloat16>(": "fp8 quantization",
        "void jetrl::(anonymous namespace)::quantize_tile_kernel<__nv_bfloat16, true, false>": "fp8 quantization",
        # Inductor's kernels named after the quantization they feed: the SiLU-mul and RMSNorm before it
        "triton_poi_fused_mul_quantize_1x128_rows_silu_slice_1": "norm / rope / activation",
        "triton_red_fused__to_copy_add_mean_mul_pow_quantize_1x128_rows_rsqrt_0": "norm / rope / activation",
        "void vllm::rms_norm_per_block_quant_kernel<c10::BFloat16>(": "fp8 quantization",  # fused norm + quant
        "void vllm::per_token_group_quant_8bit_kernel<c10::BFloat16, c10::Float8_e4m3fn": "fp8 quantization",
        "void vllm::reshape_and_cache_flash_kernel<__nv_bfloat16, __nv_bfloat16, (vllm::": "kv cache write",
        "triton_red_fused_argmax_div_exponential_0": "sampling",
        "void vllm::rms_norm_kernel<c10::BFloat16, 8, 4>(": "norm / rope / activation",
        "void jetrl::copy_segments_kernel(": "copies",
        "void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<c10::": "elementwise",
        "some_other_kernel": "other",
        # TP's collectives: "ReduceScatter" holds elementwise's "reduce" and copies' "cat"
        "ncclDevKernel_ReduceScatter_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)": "communication",
        "ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)": "communication",
        "void vllm::cross_device_reduce_1stage<__nv_bfloat16, 2>(vllm::RankData*, vllm::RankSignals": "communication",
    }
    for name, want in names.items():
        assert by_class({name: 1.0}, STEP_KERNEL_CLASSES) == {want: 1.0}, name


def test_a_chosen_step_records_its_phases_and_others_nothing(tmp_path):
    profiler = StepProfiler((2,), torch.device("cpu"))
    with profiler.phase(1, "generate"):
        pass
    assert profiler.write(1, tmp_path) is None and not (tmp_path / "profiles").exists()
    for _ in range(2):  # dynamic sampling's second round adds to the first
        with profiler.phase(2, "generate"):
            time.sleep(0.01)
    with profiler.phase(2, "update"):
        pass
    path = profiler.write(2, tmp_path)
    data = json.loads(path.read_text())
    assert path == tmp_path / "profiles" / "step_2.json" and data["device"] == "cpu"
    assert list(data["phases"]) == ["generate", "update"] and data["phases"]["generate"]["wall_s"] >= 0.02
    assert profiler.write(2, tmp_path / "again") is None  # written once, then forgotten


def test_kernel_ms_counts_kernels_not_the_operators_that_launched_them():
    from types import SimpleNamespace

    from megatron_jetrl.runtime.profiling import kernel_ms

    cpu, cuda = torch.autograd.DeviceType.CPU, torch.autograd.DeviceType.CUDA
    events = [SimpleNamespace(key="aten::mul", device_type=cpu, device_time_total=500.0),  # its kernels' time
              SimpleNamespace(key="vectorized_elementwise_kernel<mul>", device_type=cuda, device_time_total=500.0),
              SimpleNamespace(key="Memcpy DtoD", device_type=cuda, device_time_total=90.0),
              SimpleNamespace(key="cudaGraphLaunch", device_type=cuda, device_time_total=70.0),
              # c10d's GPU annotation around the collective's kernel: the same time again
              SimpleNamespace(key="nccl:_all_gather_base", device_type=cuda, device_time_total=300.0,
                              is_user_annotation=True),
              SimpleNamespace(key="ncclDevKernel_AllGather_RING_LL", device_type=cuda, device_time_total=300.0,
                              is_user_annotation=False)]
    prof = SimpleNamespace(key_averages=lambda: events)
    assert kernel_ms(prof) == {"vectorized_elementwise_kernel<mul>": 0.5, "ncclDevKernel_AllGather_RING_LL": 0.3}


def test_operator_ms_is_each_operators_own_kernel_time():
    """The step profile's trainer phases name the torch call behind a kernel: an operator's own
    kernels only (a copy inside ``aten::reshape`` counts for ``aten::copy_``), operators that launched
    nothing left out."""
    from types import SimpleNamespace

    from megatron_jetrl.runtime.profiling import OPERATOR_PHASES, operator_ms

    events = [SimpleNamespace(key="aten::reshape", self_device_time_total=0.0),
              SimpleNamespace(key="aten::copy_", self_device_time_total=146_000.0),
              SimpleNamespace(key="aten::empty", self_device_time_total=0.0),
              SimpleNamespace(key="void at::native::elementwise_kernel<128, 4>", self_device_time_total=146_000.0)]
    assert operator_ms(SimpleNamespace(key_averages=lambda: events)) == {"aten::copy_": 146.0}
    assert "generate" not in OPERATOR_PHASES and {"logprobs", "update"} <= set(OPERATOR_PHASES)


def _spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def _wait(seconds: float) -> None:
    time.sleep(seconds)


def test_host_sampler_splits_the_wall_time_by_function_and_times_the_gc():
    import gc

    from megatron_jetrl.runtime.profiling import HostSampler

    gc.collect()  # the garbage of earlier tests (its finalizers would run inside the sampled work)
    start = time.perf_counter()
    with HostSampler(interval=0.001) as host:
        _spin(0.3)
        _wait(0.2)
        gc.collect()
    wall = time.perf_counter() - start
    result = host.result()
    me = "unit/test_runtime_profiling.py"
    assert 0.7 * wall <= result["sampled_s"] <= wall, result
    assert 0.2 <= result["inclusive_s"][f"{me}:_spin"] <= 0.4, result  # a Python stretch, counted whole
    assert 0.12 <= result["self_s"][f"{me}:_wait"] <= 0.3, result  # blocked: the waiting function on top
    callers = [f for f in result["inclusive_s"] if f.startswith(("_pytest/", "pluggy/", f"{me}:test_"))]
    assert not callers, result  # the frames that entered the sampler are on every sample: left out
    assert result["gc_collections"] >= 1 and result["gc_s"] > 0
    assert result["self_s"].get(HostSampler.GC, 0.0) <= result["gc_s"] + 0.01, result
    assert len(result["self_s"]) <= 15


def test_a_profiled_phase_records_the_host_split(tmp_path):
    profiler = StepProfiler((1,), torch.device("cpu"))
    for _ in range(2):
        with profiler.phase(1, "generate"):
            _spin(0.05)
    host = json.loads(profiler.write(1, tmp_path).read_text())["phases"]["generate"]["host"]
    assert set(host) == {"sampled_s", "gc_s", "gc_collections", "self_s", "inclusive_s"}
    assert host["inclusive_s"]["unit/test_runtime_profiling.py:_spin"] >= 0.05  # both entries added up
