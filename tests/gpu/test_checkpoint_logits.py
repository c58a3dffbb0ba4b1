"""megatron-core's GPTModel, loaded from a converted checkpoint through its own sharded_state_dict(),
gives the HF model's logits at TP=1 and TP=2 (BF16 tolerance), for every family."""

import os

import pytest
import torch

from tests.model_fixtures import FAMILIES, load_tool, save_tiny_hf
from megatron_jetrl.launch import free_port
from tests.helpers import run_ranks

pytestmark = pytest.mark.gpu
SEQ, BATCH = 96, 2


def _tokens(vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))


def _megatron_worker(rank, world, port, hf_dir, ckpt, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), NCCL_NVLS_ENABLE="0",
                      TORCH_SYMM_MEM_DISABLE_MULTICAST="1")
    torch.cuda.set_device(rank)
    torch.distributed.init_process_group("nccl", rank=rank, world_size=world)
    from megatron.core import dist_checkpointing, parallel_state, tensor_parallel

    try:
        from megatron.core.models.gpt import GPTModel
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        from megatron.core.transformer import TransformerConfig

        from megatron_jetrl.models import ParallelLayout, bridge_for
        from megatron_jetrl.models.hf_checkpoint import HFCheckpoint

        parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)
        tensor_parallel.model_parallel_cuda_manual_seed(0)
        bridge = bridge_for(HFCheckpoint(hf_dir).config)
        layout = ParallelLayout(tp=world)
        config = TransformerConfig(**bridge.transformer_config_kwargs(layout))
        spec = get_gpt_layer_local_spec(qk_layernorm=bridge.dims.qk_norm, normalization="RMSNorm")
        model = GPTModel(config=config, transformer_layer_spec=spec, parallel_output=False,
                         **bridge.gpt_model_kwargs(layout)).cuda()
        model.load_state_dict(dist_checkpointing.load(model.sharded_state_dict(), ckpt))
        model.eval()
        tokens = _tokens(bridge.dims.vocab_size).cuda()
        positions = torch.arange(SEQ, device="cuda").expand(BATCH, SEQ)
        with torch.no_grad():
            logits = model(tokens, positions, attention_mask=None)[..., : bridge.dims.vocab_size]
        results.put((rank, logits.float().cpu() if rank == 0 else None, None))
    except Exception:  # reported to the test
        import traceback

        results.put((rank, None, traceback.format_exc()))
    finally:
        parallel_state.destroy_model_parallel()
        torch.distributed.destroy_process_group()


def _megatron_logits(hf_dir, ckpt, tp):
    port = free_port()
    outcomes = run_ranks(_megatron_worker, tp, tp, port, str(hf_dir), str(ckpt), timeout=300)
    for rank, _, error in outcomes:
        assert error is None, f"rank {rank} failed:\n{error}"
    return outcomes[0][1]


@pytest.fixture(scope="module", params=FAMILIES)
def converted(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    model = save_tiny_hf(request.param, root / "hf")
    assert load_tool("convert_hf_to_megatron")(["--hf-dir", str(root / "hf"), "--out-dir", str(root / "mg")]) == 0
    tokens = _tokens(model.config.vocab_size).cuda()
    with torch.no_grad():
        hf_bf16 = model.cuda()(tokens).logits.float().cpu()
        reference = model.float()(tokens).logits.cpu()
    return root, hf_bf16, reference


@pytest.mark.parametrize("tp", [1, 2])
def test_megatron_logits_equal_hf_logits(converted, tp):
    if torch.cuda.device_count() < tp:
        pytest.skip(f"TP={tp} needs {tp} GPUs; this host has {torch.cuda.device_count()}")
    root, hf_bf16, reference = converted
    logits = _megatron_logits(root / "hf", root / "mg", tp)
    assert logits.shape == reference.shape

    def rel(x):
        return ((x - reference).norm() / reference.norm()).item()

    # Both run in BF16; megatron's error against the fp32 HF model must be of the same size as the
    # HF model's own BF16 error (a wrong layout gives errors near 100%).
    assert rel(logits) < max(2 * rel(hf_bf16), 1e-2), (rel(logits), rel(hf_bf16))
    assert (logits.argmax(-1) == reference.argmax(-1)).float().mean() > 0.9
