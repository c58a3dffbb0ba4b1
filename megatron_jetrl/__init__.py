"""megatron-jetrl: RL post-training on megatron-core with one unified FP8 precision flow.

The trainer's FProp and the rollout engine compute with the same FP8 weight bytes and scales;
``megatron_jetrl.precision`` defines that contract once.
"""

__version__ = "0.1.0"
