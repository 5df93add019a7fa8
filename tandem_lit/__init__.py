"""tandem-lit: tandem training of language models with PyTorch Lightning.

A trainable senior LM and a frozen, weaker junior LM co-write each RL rollout; a verifier rewards
the joint answer; REINFORCE or GRPO updates the senior only.
"""

__version__ = "0.1.0"
