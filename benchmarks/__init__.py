"""Benchmarks: each module is a script (``python benchmarks/<name>.py --help``) whose results go to
``benchmarks/results/``; the ones that others build on (``load``, ``box_load``, ``cluster_sim``, ``compare_algorithms``)
are imported as ``benchmarks.<name>``. The package is installed with rapo_ray (editable), so those imports work from a
script, a test or a notebook alike."""
