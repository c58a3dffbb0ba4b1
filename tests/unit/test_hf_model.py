"""The bridge registry is the hf engine's one list of architectures: every bridge resolves to its
transformers model and RMSNorm classes, and one transformers lacks is refused by name."""

import pytest
import torch
import transformers

from megatron_jetrl.models import BRIDGES
from megatron_jetrl.models.families import Qwen3Bridge
from megatron_jetrl.rollout.hf_model import hf_classes


@pytest.mark.parametrize("architecture", sorted(BRIDGES))
def test_every_bridge_resolves_to_transformers_classes(architecture):
    bridge = BRIDGES[architecture]
    model_cls, norm_cls = hf_classes(bridge)
    assert issubclass(model_cls, transformers.PreTrainedModel) and model_cls.__name__ == architecture
    assert model_cls.config_class.model_type == bridge.model_type
    assert issubclass(norm_cls, torch.nn.Module) and norm_cls.__name__ == bridge.hf_norm
    assert norm_cls.__module__ == f"transformers.models.{bridge.model_type}.modeling_{bridge.model_type}"


def test_an_architecture_transformers_lacks_is_named():
    class Missing(Qwen3Bridge):
        architecture = "NoSuchModelForCausalLM"

    with pytest.raises(ImportError, match=r"^architecture NoSuchModelForCausalLM: transformers \S+ has no "
                                          r"NoSuchModelForCausalLM; "):
        hf_classes(Missing)

    class MissingNorm(Qwen3Bridge):
        hf_norm = "NoSuchRMSNorm"

    with pytest.raises(ImportError, match=r"^architecture Qwen3ForCausalLM: transformers \S+ has no "
                                          r"transformers\.models\.qwen3\.modeling_qwen3\.NoSuchRMSNorm; "):
        hf_classes(MissingNorm)

    class MissingModule(Qwen3Bridge):
        model_type = "no_such_type"

    with pytest.raises(ImportError, match=r"has no transformers\.models\.no_such_type\.modeling_no_such_type\."):
        hf_classes(MissingModule)
