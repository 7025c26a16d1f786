"""The cache of transformers' two import-time scans (rapo_ray/core/transformers_import_cache.py): what it returns is
what the scans return, it is rebuilt when what it depends on changes, and it never breaks an import."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest

from rapo_ray.core import transformers_import_cache as tic

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    folder = tmp_path / "cache"
    monkeypatch.setenv(tic.CACHE_DIR_ENV, str(folder))
    return folder


class CountingScan:
    def __init__(self, value):
        self.value, self.calls = value, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.value


def test_packages_distributions_is_rescanned_when_a_sys_path_folder_changes(cache, tmp_path, monkeypatch):
    site = tmp_path / "site"
    site.mkdir()
    monkeypatch.syspath_prepend(str(site))
    scan = CountingScan({"yaml": ["PyYAML"], "PIL": ["pillow"]})
    assert tic._cached_packages_distributions(scan) == scan.value and scan.calls == 1
    assert tic._cached_packages_distributions(scan) == scan.value and scan.calls == 1  # from the file
    (site / "newpkg-1.0.dist-info").mkdir()  # what an install does to the folder
    os.utime(site, ns=(0, os.stat(site).st_mtime_ns + 1_000_000))  # the folder's time moves even on a coarse clock
    scan.value = {"yaml": ["PyYAML"], "newpkg": ["newpkg"]}
    assert tic._cached_packages_distributions(scan) == scan.value and scan.calls == 2
    assert len(list(cache.glob("packages_distributions-*.json"))) == 1  # the entry was replaced, not added to


def _structure():
    return {
        frozenset(): {"models.qwen2.configuration_qwen2": {"Qwen2Config"}},
        frozenset({"torch"}): {"m.x": {"A", "B"}},
    }


def test_import_structure_is_rebuilt_for_a_new_version_or_a_changed_folder(cache, tmp_path, monkeypatch):
    """Each ``tic._caching_define_import_structure(real)`` stands for a new process (within one, a place is built
    once and the same object returned, as transformers' own lru_cache does)."""
    folder = tmp_path / "site-packages" / "transformers" / "models"
    folder.mkdir(parents=True)
    monkeypatch.setitem(sys.modules, "transformers", types.SimpleNamespace(__version__="5.0.0"))
    real = CountingScan(_structure())
    define = tic._caching_define_import_structure(real)
    first = define(folder, prefix="models")
    assert first == _structure() and real.calls == 1 and define(folder, prefix="models") is first

    def in_a_new_process(*args, **kwargs):
        return tic._caching_define_import_structure(real)(*args, **kwargs)

    got = in_a_new_process(folder, prefix="models")
    assert got == _structure() and real.calls == 1  # sets and frozensets again, from the JSON entry
    assert all(isinstance(k, frozenset) and all(isinstance(v, set) for v in m.values()) for k, m in got.items())
    assert in_a_new_process(folder / "__init__.py") == _structure() and real.calls == 2  # another place, its entry
    sys.modules["transformers"].__version__ = "5.1.0"
    in_a_new_process(folder, prefix="models")
    assert real.calls == 3
    (folder / "new_model").mkdir()
    os.utime(folder, ns=(0, os.stat(folder).st_mtime_ns + 1_000_000))
    in_a_new_process(folder, prefix="models")
    assert real.calls == 4
    in_a_new_process(folder, prefix="models")
    assert real.calls == 4


def test_a_source_checkout_of_transformers_is_never_cached(cache, tmp_path, monkeypatch):
    """Its files are edited in place, which no folder time shows."""
    folder = tmp_path / "src" / "transformers" / "models"
    folder.mkdir(parents=True)
    monkeypatch.setitem(sys.modules, "transformers", types.SimpleNamespace(__version__="5.0.0.dev0"))
    real = CountingScan(_structure())
    tic._caching_define_import_structure(real)(folder)
    tic._caching_define_import_structure(real)(folder)
    assert real.calls == 2 and not cache.exists()


def test_corrupt_or_foreign_entries_and_an_unwritable_folder_fall_back_to_the_scan(cache, tmp_path, monkeypatch):
    site = tmp_path / "site"
    site.mkdir()
    monkeypatch.syspath_prepend(str(site))
    scan = CountingScan({"yaml": ["PyYAML"]})
    tic._cached_packages_distributions(scan)
    (entry,) = cache.glob("packages_distributions-*.json")
    for bad in ("{not json", json.dumps({"format": 0, "key": {}, "value": {}}), json.dumps([1, 2])):
        entry.write_text(bad)
        assert tic._cached_packages_distributions(scan) == scan.value
    assert scan.calls == 4 and json.loads(entry.read_text())["format"] == tic._FORMAT  # rewritten whole
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    monkeypatch.setenv(tic.CACHE_DIR_ENV, str(blocker / "cache"))  # a folder that cannot be made
    assert tic._cached_packages_distributions(scan) == scan.value and scan.calls == 5


def test_the_cache_can_be_turned_off(monkeypatch):
    monkeypatch.setenv(tic.CACHE_DIR_ENV, "off")
    assert tic.cache_dir() is None
    assert tic.cache_transformers_import_scans() is False  # (transformers is imported here already anyway)


def test_a_warm_process_imports_transformers_without_scanning_and_sees_the_same_tables(tmp_path, tiny_model_dir):
    """Three processes load the tiny tokenizer: one with the cache off, one that scans and writes the cache, and one
    that must not call ``packages_distributions`` at all (it raises there). All three end with the same tables:
    transformers' distribution map and its lazy module's names."""
    code = textwrap.dedent(
        f"""
        import importlib.metadata as md, json, sys
        if sys.argv[1] == "warm":
            def no_scan():
                raise AssertionError("scanned")
            md.packages_distributions = no_scan
        from rapo_ray.model.factory import load_tokenizer
        load_tokenizer({str(tiny_model_dir)!r})
        import transformers, transformers.utils.import_utils as iu
        names = sorted(transformers._class_to_module.items()), sorted(transformers._modules), sorted(transformers.__all__)
        print(json.dumps([iu.PACKAGE_DISTRIBUTION_MAPPING, names], sort_keys=True))
        """
    )
    tables = {}
    for phase, where in (("off", "off"), ("cold", str(tmp_path / "cache")), ("warm", str(tmp_path / "cache"))):
        out = subprocess.run(
            [sys.executable, "-c", code, phase],
            cwd=ROOT,
            env={**os.environ, tic.CACHE_DIR_ENV: where},
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert out.returncode == 0, (phase, out.stderr[-3000:])
        tables[phase] = json.loads(out.stdout.splitlines()[-1])
    assert len(tables["off"][1][0]) > 1000  # transformers' classes, not an empty table
    assert tables["off"] == tables["cold"] == tables["warm"]
    assert list((tmp_path / "cache").glob("import_structure-*.json"))  # transformers.models' table at least
