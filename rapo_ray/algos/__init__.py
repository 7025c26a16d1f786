"""The learning signal: pure torch, no Ray. Equation numbers refer to shared/RAPO_SPEC.md.

Importing the package registers the built-in algorithms (grpo, arpo, rapo) in ``rapo_ray.algos.registry``, then
those of installed packages (entry points in the group ``rapo_ray.algorithms``).
"""

from rapo_ray.algos import builtin  # noqa: F401  (registers grpo, arpo, rapo)
from rapo_ray.algos.registry import load_entry_points

load_entry_points()
