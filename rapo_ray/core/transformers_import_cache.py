"""Cache the two scans transformers does every time it is imported.

Importing transformers (5.x) costs each process that does it two scans of what is installed, before anything is
used: ``importlib.metadata.packages_distributions()`` reads the RECORD file of every installed distribution that
ships no ``top_level.txt``, and ``define_import_structure`` reads
every file under ``transformers/models`` to build its lazy-import table. Neither changes unless a package is
installed or removed, yet every rollout worker, learner rank, retrieval replica and driver repeats them, on the cores
the run is starting on (docs/RESULTS.md, Performance by component).

``cache_transformers_import_scans()`` keeps both results in JSON files under ``RAPO_IMPORT_CACHE_DIR`` (default
``$XDG_CACHE_HOME/rapo_ray/transformers-imports``, ``~/.cache/...`` without it; ``off`` turns the cache off). An entry is used only while
its key still holds:

- the installed distributions: ``sys.path`` and the modification time of each of its folders (installing,
  upgrading or removing a package adds or removes a ``*.dist-info`` folder there, which changes that time);
- the import table: transformers' version, the scanned folder and its modification time. A transformers that is not
  under ``site-packages`` (a source checkout, whose files are edited in place) is never cached.

Anything unexpected (no writable cache folder, a corrupt or foreign entry, a transformers whose internals moved)
falls back to transformers' own scan: the cache can make an import faster, never wrong or failing.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.machinery
import importlib.metadata
import json
import os
import sys
from pathlib import Path

from rapo_ray.core.files import write_json_atomic

_TARGET = "transformers.utils.import_utils"
CACHE_DIR_ENV = "RAPO_IMPORT_CACHE_DIR"
_FORMAT = 1  # bump when an entry's layout changes


def cache_dir() -> Path | None:
    """The cache folder, or None where the cache is turned off."""
    where = os.environ.get(CACHE_DIR_ENV, "")
    if where.lower() == "off":
        return None
    if where:
        return Path(where)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "rapo_ray" / "transformers-imports"


def cache_transformers_import_scans() -> bool:
    """Serve transformers' two import-time scans from the cache in this process. Call it before transformers is
    first imported; returns False where that import has happened already (the call then changes nothing) or the
    cache is off. Safe to call any number of times."""
    if _TARGET in sys.modules or cache_dir() is None:
        return False
    if not any(isinstance(f, _ImportScanFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _ImportScanFinder())
    return True


class _ImportScanFinder:
    """Finds ``transformers.utils.import_utils`` as the normal path finder would, and wraps its execution: the
    module-level ``packages_distributions()`` call is answered from the cache, and the module's
    ``define_import_structure`` is replaced by a caching one before ``transformers/__init__`` imports it."""

    def find_spec(self, name, path=None, target=None):
        if name != _TARGET:
            return None
        sys.meta_path[:] = [f for f in sys.meta_path if f is not self]  # one module, once
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or not hasattr(spec.loader, "exec_module"):
            return spec
        run_module = spec.loader.exec_module  # this spec's own loader instance: no other module is touched

        def exec_module(module):
            real_scan = importlib.metadata.packages_distributions
            importlib.metadata.packages_distributions = lambda: _cached_packages_distributions(real_scan)
            try:
                run_module(module)
            finally:
                importlib.metadata.packages_distributions = real_scan
            real_define = getattr(module, "define_import_structure", None)
            if callable(real_define):
                module.define_import_structure = _caching_define_import_structure(real_define)

        spec.loader.exec_module = exec_module
        return spec


# ---------------------------------------------------------------- the two entries


def _cached_packages_distributions(real_scan) -> dict[str, list[str]]:
    key = {"sys.path": [[p, _mtime_ns(p or ".")] for p in sys.path]}
    place = ("packages_distributions", *sys.path)
    hit = _read(place, key)
    if isinstance(hit, dict) and all(isinstance(v, list) for v in hit.values()):
        return hit
    mapping = real_scan()
    _write(place, key, {k: list(v) for k, v in mapping.items()})
    return mapping


def _caching_define_import_structure(real_define):
    made: dict = {}  # transformers' own function is an lru_cache (and its caller mutates what it returns): one object
    # per place in a process, as there

    @functools.wraps(real_define)
    def define_import_structure(module_path, prefix=None):
        if (str(module_path), prefix) not in made:
            made[str(module_path), prefix] = _define_import_structure(real_define, module_path, prefix)
        return made[str(module_path), prefix]

    return define_import_structure


def _define_import_structure(real_define, module_path, prefix):
    folder = Path(module_path)
    folder = folder if folder.is_dir() else folder.parent  # a file stands for its folder, as transformers reads it
    transformers_mod = sys.modules.get("transformers")
    version = getattr(transformers_mod, "__version__", None)
    if version is None or not any(part in ("site-packages", "dist-packages") for part in folder.parts):
        return real_define(module_path, prefix)
    key = {"version": version, "path": str(module_path), "prefix": prefix, "folder_mtime": _mtime_ns(folder)}
    place = ("import_structure", str(module_path), str(prefix))
    hit = _read(place, key)
    if hit is not None:
        try:
            return {frozenset(backends): {m: set(objs) for m, objs in mods.items()} for backends, mods in hit}
        except (TypeError, ValueError, AttributeError):
            pass
    structure = real_define(module_path, prefix)
    try:
        rows = [[sorted(b), {m: sorted(o) for m, o in mods.items()}] for b, mods in structure.items()]
    except (TypeError, AttributeError):  # a layout this cache does not know: used as is, not stored
        return structure
    _write(place, key, rows)
    return structure


# ---------------------------------------------------------------- files


def _mtime_ns(path) -> int | None:
    try:
        return os.stat(path).st_mtime_ns
    except OSError:
        return None


def _entry_path(place: tuple[str, ...]) -> Path | None:
    """One file per scanned place: a new key overwrites the old entry instead of adding one."""
    folder = cache_dir()
    if folder is None:
        return None
    return folder / f"{place[0]}-{hashlib.sha256(json.dumps(place).encode()).hexdigest()[:16]}.json"


def _read(place: tuple[str, ...], key: dict):
    path = _entry_path(place)
    try:
        entry = json.loads(path.read_text()) if path is not None else None
    except (OSError, ValueError):
        return None
    if not isinstance(entry, dict) or entry.get("format") != _FORMAT or entry.get("key") != key:
        return None
    return entry.get("value")


def _write(place: tuple[str, ...], key: dict, value) -> None:
    path = _entry_path(place)
    if path is None:
        return
    try:
        write_json_atomic(path, {"format": _FORMAT, "key": key, "value": value}, indent=None)
    except OSError:
        pass  # no writable cache folder: transformers' own scans next time too
