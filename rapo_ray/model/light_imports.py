"""Keep scikit-learn and SciPy out of processes that load a model.

transformers imports both whenever they are installed (they are here: sentence-transformers, the packaged MiniLM's
dependency, needs them), in modules every causal LM loads: its generation module imports scikit-learn (with SciPy)
for assisted decoding's confidence threshold, and its loss registry imports ``scipy.optimize`` for the Hungarian
matching of object-detection losses. Nothing here uses either, and they cost every learner rank, rollout worker and
retrieval replica CPU at start, on the cores the run is starting on: hiding SciPy as well takes ~0.5 s off each
model-loading process (docs/RESULTS.md, Performance by component)."""

from __future__ import annotations

import sys

from rapo_ray.core.transformers_import_cache import cache_transformers_import_scans

_FIRST_IMPORTERS = ("transformers.generation.candidate_generator", "transformers.loss.loss_for_object_detection")


def hide_unused_packages_from_transformers() -> bool:
    """Make transformers see no scikit-learn and no SciPy, before the modules that import them are first imported.
    Returns False where one of those is loaded already (the call is then too late and changes nothing); safe to call
    any number of times. Assisted decoding with a confidence threshold, or an object-detection loss, then raises
    transformers' own 'needs scikit-learn' / 'needs scipy' error. SciPy itself stays importable (the lexical
    retrieval backend uses ``scipy.sparse``)."""
    if any(name in sys.modules for name in _FIRST_IMPORTERS):
        return False
    cache_transformers_import_scans()  # transformers' import below is its first in most processes
    import transformers.utils
    from transformers.utils import import_utils

    def not_installed() -> bool:
        return False

    for module in (transformers.utils, import_utils):
        module.is_sklearn_available = not_installed
        module.is_scipy_available = not_installed
    return True
