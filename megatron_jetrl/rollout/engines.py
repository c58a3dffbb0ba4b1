"""The table of rollout engines (``ENGINES``), by ``rollout.engine`` name.

Each engine has its options section in ``settings.py`` (its keys, its own validation, what it needs
for a job's sequences and for an exact rollout: ``check_sequence``, ``exact_rules``, the keys other
rules name) and one ``EngineKind`` here: what it can do (the exact rollout), the environment it must
be imported with, what the machine must have, and its factory. No code outside ``rollout/`` tests
``rollout.engine`` by name (``tests/unit/test_engines.py`` keeps it so). The factories import their
engine when called, so the table imports quickly for config validation.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Optional

from megatron_jetrl.rollout.settings import HfOptions, RolloutSettings, VllmOptions

if TYPE_CHECKING:
    import torch

    from megatron_jetrl.precision import PrecisionRecipe
    from megatron_jetrl.rollout.base import RolloutEngine


@dataclass(frozen=True)
class EngineKind:
    """One engine: ``options`` is its section's class (the section is named like the engine);
    ``exact``: it can run ``precision.exact``; ``environment``:
    variables it must be imported with (the launcher sets them); ``requirements``: what this machine
    must have, each a callable raising ``ConfigError`` naming the fix; ``build``: the factory;
    ``package`` / ``label``: the Python package it runs on and its name in messages;
    ``exact_verified``: the package's minor versions whose exact rollout a GPU run verified (on
    others the start-up self-check of every exact job decides, ``Trainer.exact_self_check``)."""

    name: str
    options: type
    exact: bool
    environment: Callable[["PrecisionRecipe", Any], dict[str, str]]
    requirements: Callable[[Any], list[Callable[[], object]]]
    build: Callable[..., "RolloutEngine"]
    package: str
    label: str
    exact_verified: tuple[str, ...] = ()

    def version(self) -> Optional[str]:
        """The installed version of ``package`` (its metadata; nothing is imported), or None."""
        try:
            return importlib.metadata.version(self.package)
        except importlib.metadata.PackageNotFoundError:
            return None

    def describe(self) -> str:
        """The engine and its version, for a message: ``vllm engine, vLLM 0.26.0``."""
        return f"{self.name} engine, {self.label} {self.version() or 'not installed'}"

    def exact_status(self) -> str:
        """Whether the installed version's exact rollout was verified on a GPU, for ``jetrl check``."""
        version = self.version()
        if version is None:
            return f"{self.label} not installed here"
        if ".".join(version.split(".")[:2]) in self.exact_verified:
            return f"{self.label} {version}: exactness GPU-verified"
        return (f"{self.label} {version}: exactness not GPU-verified on this version, the start-up self-check "
                "decides")


def _build_hf(options: HfOptions, recipe: "PrecisionRecipe", hf_config: dict, *, device: "torch.device",
              max_model_len: int) -> "RolloutEngine":
    from megatron_jetrl.rollout.hf_engine import HfEngine

    return HfEngine(hf_config, recipe, options, device=device)


def _build_vllm(options: VllmOptions, recipe: "PrecisionRecipe", hf_config: dict, *, device: "torch.device",
                max_model_len: int) -> "RolloutEngine":
    from megatron_jetrl.rollout.vllm_engine import VllmEngine

    if options.max_model_len is None:
        options = dataclasses.replace(options, max_model_len=max_model_len)
    return VllmEngine(hf_config, recipe, options)


def _vllm_environment(recipe: "PrecisionRecipe", options: VllmOptions) -> dict[str, str]:
    from megatron_jetrl.rollout.vllm_engine import engine_env

    return engine_env(recipe, options)


def _vllm_requirements(options: VllmOptions) -> list[Callable[[], object]]:
    from megatron_jetrl.rollout.vllm_engine import require_vllm_version

    return [require_vllm_version]


ENGINES: dict[str, EngineKind] = {
    "hf": EngineKind(
        name="hf", options=HfOptions, exact=False, environment=lambda recipe, options: {},
        requirements=lambda options: [], build=_build_hf, package="transformers", label="transformers"),
    "vllm": EngineKind(
        name="vllm", options=VllmOptions, exact=True, environment=_vllm_environment,
        requirements=_vllm_requirements, build=_build_vllm, package="vllm", label="vLLM", exact_verified=("0.26",)),
}
"""The engines, by ``rollout.engine`` name (``RolloutSettings.engine``'s ``Literal``: a test keeps them
equal, and keeps each entry's ``options`` the type of the ``rollout`` field of the same name)."""


def engine_kind(settings: RolloutSettings) -> EngineKind:
    """The entry of the engine a job's ``rollout`` section chose."""
    return ENGINES[settings.engine]
