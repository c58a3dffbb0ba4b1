"""The command lines the GPU tests build, checked where no GPU is: a GPU session is too short to find
there that a test's own arguments are refused (the CLI refuses a config key given twice)."""

import subprocess

import pytest

from megatron_jetrl.config.errors import ConfigError
from megatron_jetrl.config.loader import apply_overrides, load_yaml
from tests.gpu import test_exact_guard


def test_the_guard_tests_own_override_replaces_the_shared_default(tmp_path, monkeypatch):
    """test_exact_guard's runs pass the shared exact settings plus a test's own: a key the test gives
    (log.console=true) replaces the shared default (log.console=false) instead of being given twice,
    and every other shared setting stays."""
    seen = []

    def fake_run(argv, **kwargs):
        seen.append(argv)
        return subprocess.CompletedProcess(argv, 0, "", "")

    monkeypatch.setattr(test_exact_guard.subprocess, "run", fake_run)
    test_exact_guard._run(tmp_path, 0, "log.console=true", "precision.exact_mismatch=correct")
    argv = seen[0]
    config, overrides = argv[argv.index("--") + 1], argv[argv.index("--") + 2:]
    raw = apply_overrides(load_yaml(config), overrides)  # raises on a key given twice
    assert raw["log"]["console"] is True and raw["precision"]["exact_mismatch"] == "correct"
    assert raw["precision"]["exact"] is True and raw["rollout"]["engine"] == "vllm" and raw["run"]["steps"] == 3
    with pytest.raises(ConfigError, match="given twice"):  # the check above can fail: the loader refuses duplicates
        apply_overrides(load_yaml(config), [*overrides, "log.console=false"])
