"""Contract tests against the installed vLLM (the vLLM venv of ``.ci/run``; skipped elsewhere).

vLLM picks its platform on first use from ``VLLM_TARGET_DEVICE``: these tests build vLLM's model
classes on its CPU platform, so the variable is set here, before any test module imports vLLM.
(The test process plays the launcher; the package itself never sets environment variables.)
"""

import os

os.environ["VLLM_TARGET_DEVICE"] = "cpu"
