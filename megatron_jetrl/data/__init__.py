"""Prompts, samplers, filters and rewards for the RL loop.

Import the submodules directly (``megatron_jetrl.data.sampler``, ``.datasets``, ``.rewards``, ...).
This file re-exports nothing on purpose: the math-reward worker processes start fresh interpreters
that import ``timed_pool`` and ``math_answer`` (stdlib only), and an eager package import here would
make every one of them load torch.
"""
