"""The offline demo: a synthetic arithmetic world and tiny senior/junior pairs built from it.

``configs/demo.yaml`` runs tandem RL on ``demo://senior`` and ``demo://junior`` (the skill gap),
``configs/demo_language.yaml`` on ``demo://language/senior`` and ``demo://language/junior`` (the
language gap); see docs/demo.md.
"""

from tandem_lit.data.world import Calc, Problem, problems
from tandem_lit.demo.build import RECIPES, LanguagePhase, Phase, Recipe, Shape, cache_root, demo_model_dir, ensure_built
from tandem_lit.models import register_resolver

register_resolver("demo", demo_model_dir)

__all__ = [
    "RECIPES", "Calc", "LanguagePhase", "Phase", "Problem", "Recipe", "Shape", "cache_root", "demo_model_dir", "ensure_built",
    "problems",
]
