"""The offline demo: a synthetic arithmetic world and a tiny senior/junior pair built from it.

``configs/demo.yaml`` runs tandem RL on ``demo://senior`` and ``demo://junior``; see docs/demo.md.
"""

from tandem_lit.demo.build import RECIPES, Phase, Recipe, Shape, cache_root, demo_model_dir, ensure_built
from tandem_lit.demo.world import Calc, Problem, problems

__all__ = ["RECIPES", "Calc", "Phase", "Problem", "Recipe", "Shape", "cache_root", "demo_model_dir", "ensure_built", "problems"]
