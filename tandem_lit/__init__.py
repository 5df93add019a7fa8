"""tandem-lit: tandem training of language models with PyTorch Lightning.

A trainable senior LM and a frozen, weaker junior LM co-write each RL rollout; a verifier rewards
the joint answer; REINFORCE or GRPO updates the senior only. The package map is in
docs/architecture.md.
"""

import importlib.abc
import sys

__version__ = "0.2.0"

# Modules that moved: when the package was split into training/, evaluation/, rollout/static/ and
# models/ (0.2.0), and since (the step's record beside the other rollout records). Importing an old
# path fails with one line that names the new one, rather than with a bare ModuleNotFoundError (or
# a second copy of the module under the old name).
MOVED = {
    "tandem_lit.module": "tandem_lit.training.module (TandemModule: tandem_lit.training.TandemModule)",
    "tandem_lit.settings": "tandem_lit.training.settings",
    "tandem_lit.memory": "tandem_lit.training.memory",
    "tandem_lit.distributed": "tandem_lit.training.distributed",
    "tandem_lit.sft": "tandem_lit.training.sft",
    "tandem_lit.callbacks": "tandem_lit.training.callbacks",
    "tandem_lit.export": "tandem_lit.training.export",
    "tandem_lit.eval_steps": "tandem_lit.evaluation.steps",
    "tandem_lit.forced_token": "tandem_lit.evaluation.forced_token",
    "tandem_lit.metrics": "tandem_lit.evaluation.metrics",
    "tandem_lit.language": "tandem_lit.evaluation.language",
    "tandem_lit.results": "tandem_lit.rollout.result",
    "tandem_lit.evaluation.results": "tandem_lit.rollout.result (RolloutResult: tandem_lit.rollout.RolloutResult)",
    "tandem_lit.logprobs": "tandem_lit.rollout.logprobs",
    "tandem_lit.tiny": "tandem_lit.models.tiny",
    "tandem_lit.rollout.fast": "tandem_lit.rollout.static (FastEngine: tandem_lit.rollout.FastEngine)",
    "tandem_lit.rollout.hybrid": "tandem_lit.rollout.static.hybrid",
    "tandem_lit.rollout.kernels": "tandem_lit.rollout.static.kernels",
    "tandem_lit.demo.world": "tandem_lit.data.world",
}


class _MovedModules(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name in MOVED:
            raise ModuleNotFoundError(f"{name} moved to {MOVED[name]}", name=name)
        return None


sys.meta_path.insert(0, _MovedModules())
