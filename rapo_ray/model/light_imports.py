"""Keep scikit-learn out of processes that load a model.

transformers' generation module (imported by every ``AutoModel*`` class and every causal LM) imports scikit-learn,
and with it SciPy, whenever scikit-learn is installed (it is here: sentence-transformers, the packaged MiniLM's
dependency, needs it). The import is only for assisted decoding's confidence threshold, which nothing here uses, and
it costs every learner rank, rollout worker and retrieval replica CPU at start, on the cores the run is starting on
(docs/RESULTS.md, Performance by component)."""

from __future__ import annotations

import sys

_GENERATION_MODULE = "transformers.generation.candidate_generator"


def hide_sklearn_from_transformers() -> bool:
    """Make transformers see no scikit-learn, before its generation module is first imported. Returns False where
    that module is loaded already (the call is then too late and changes nothing); safe to call any number of times.
    Assisted decoding with a confidence threshold then raises transformers' own 'needs scikit-learn' error."""
    if _GENERATION_MODULE in sys.modules:
        return False
    import transformers.utils
    from transformers.utils import import_utils

    def not_installed() -> bool:
        return False

    transformers.utils.is_sklearn_available = not_installed
    import_utils.is_sklearn_available = not_installed
    return True
