"""The SmolLM2 recipe's GRPO through ``jobs/train.py`` under Ray on a lent GPU box, colocated (issue #65).

The device box has torch and transformers but no Ray, no GGUF reader and not the packaged model; nothing can be
fetched there, and one call carries at most 64 MiB, the working tree included. So the job is prepared here and
carried over in loads:

    python benchmarks/gpu_job.py prepare                  # here, with the project installed (.venv)
    # then, through the device tool, one call per load, back to back (the box is kept 30 s after a call):
    #   run(carry=[".gpu_job/loads/load1"], command="true") ... run(carry=[".gpu_job/loads/loadN"], command=...)
    python3 benchmarks/gpu_job.py box --steps 3           # there, in the last call: join, check, install, run

``prepare`` runs a small GRPO job here (bundled model, torch engine, colocated) and the model conversion with an
import recorder in every process (driver and Ray workers alike), maps the modules they imported to the installed
distributions, leaves out those the box has (``BOX_PACKAGES``, from the device tool's list of its image), downloads
the rest as Python 3.12 manylinux wheels at the versions installed here (the packaged model is one of them), and
splits every file into parts of at most ``--part-mb``, grouped into loads of at most ``--load-mb`` under
``.gpu_job/`` (ignored by git). Each load holds the manifest: every file's size, SHA-256 and parts.

``box`` joins the parts, checks every file against the manifest (a missing load or a corrupt part is named), installs
the wheels into ``/tmp/rapo_site`` without touching the box's own packages, and runs the recipe: GRPO on the GPU,
one learner rank and one torch engine sharing it (``resources.colocate=auto`` turns on with the one GPU), a few
steps. It writes the run's metrics and summary, the peak GPU memory (nvidia-smi, polled) and the job's log to
``--out`` (the device tool's $OUT).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from importlib import metadata
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
WORK = REPO / ".gpu_job"
SITE = "/tmp/rapo_site"
PRESET = "smollm2-135m-instruct"  # the recipe's model.preset
MB = 1 << 20

# What the device box's image holds (the device tool's KINDS.md, as read on 2026-11-17): carried wheels of these
# would shadow the box's own builds (torch's CUDA wheels above all), so they are never carried.
BOX_PACKAGES = """
absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch build certifi
charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings cuda-core cuda-pathfinder
cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils execnet filelock flatbuffers flax fonttools
formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx huggingface-hub humanize hypothesis idna
imageio iniconfig interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin jaxlib jaxtyping jinja2 joblib kiwisolver
lazy-loader lightning lightning-utilities linear-operator lineax llvmlite lxml markdown markdown-it-py markupsafe
matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack multidict multipledispatch mypy-extensions nanobind narwhals
networkx ninja numba numba-cuda numpy numpyro nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime
nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile nvidia-curand nvidia-cusolver nvidia-cusparse nvidia-cusparselt-cu13
nvidia-ml-py nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx onnx-ir onnxruntime onnxscript
opencv-python-headless optax opt-einsum opt-einsum-fx optimistix orbax-checkpoint packaging pandas pathspec patsy
peft pillow pip pluggy portalocker prometheus-client propcache protobuf psutil pyarrow pybind11 py-cpuinfo pygments
pyparsing pyproject-hooks pyre-extensions pytest pytest-benchmark pytest-cov pytest-mock pytest-timeout pytest-xdist
python-dateutil pytorch-lightning pyyaml regex requests rich sacrebleu safetensors scikit-build-core scikit-image
scikit-learn scipy seaborn sentencepiece sentence-transformers setuptools shellingham simplejson six
sortedcontainers statsmodels sympy tabulate tensorboard tensorboard-data-server tensorstore threadpoolctl tifffile
tiktoken timm tokenizers toolz torch torchaudio torchdiffeq torch-geometric torchmetrics torchvision tqdm
transformers treescope triton typer typing-extensions typing-inspect urllib3 uvloop wadler-lindig werkzeug wheel
wrapt xarray xxhash yarl zipp
""".split()

# pip's platform tags for a manylinux x86_64 wheel that the box's Python 3.12 installs (pip matches each exactly)
PLATFORMS = [f"manylinux_2_{n}_x86_64" for n in (39, 35, 34, 31, 28, 27, 24, 17)] + [
    "manylinux2014_x86_64",
    "manylinux1_x86_64",
    "any",
]


def normalized(name: str) -> str:
    """A distribution's name as PEP 503 compares it."""
    return re.sub(r"[-_.]+", "-", name).lower()


# ---------------------------------------------------------------- which packages a GPU job needs

RECORDER = '''
import os, sys
_log = os.path.join(os.environ["RAPO_IMPORT_LOG"], f"{os.getpid()}.txt")
_seen = set()


def _note(top):
    if top not in _seen:
        _seen.add(top)
        with open(_log, "a") as f:
            f.write(top + "\\n")


class _Loader:
    """The real loader, noting its top-level package when a module is executed (imported, not just looked up:
    availability probes such as importlib.util.find_spec never get here)."""

    def __init__(self, loader, top):
        self._loader, self._top = loader, top

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        _note(self._top)
        return self._loader.exec_module(module)

    def __getattr__(self, name):
        return getattr(self._loader, name)


class _Recorder:
    """First on sys.meta_path: asks the other finders, and wraps the loader of what they find."""

    def find_spec(self, name, path=None, target=None):
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _Loader(spec.loader, name.partition(".")[0])
                return spec
        return None


sys.meta_path.insert(0, _Recorder())
'''


def trace_imports(commands: list[list[str]], cwd: Path = REPO) -> set[str]:
    """Top-level packages that ``commands`` imported (executed, not only looked up) in any of their processes (Ray's
    workers inherit the environment of the driver that starts a local Ray). Each command must succeed."""
    with tempfile.TemporaryDirectory(prefix="rapo_trace_") as tmp:
        hook, log = Path(tmp) / "hook", Path(tmp) / "log"
        hook.mkdir()
        log.mkdir()
        (hook / "sitecustomize.py").write_text(RECORDER)
        env = dict(os.environ, RAPO_IMPORT_LOG=str(log))
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(hook), env.get("PYTHONPATH", "")) if p)
        for cmd in commands:
            proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True)
            if proc.returncode != 0:
                raise SystemExit(
                    f"traced command failed (exit {proc.returncode}): {' '.join(cmd)}\n{proc.stderr[-3000:]}"
                )
        return {line for f in log.iterdir() for line in f.read_text().split()}


def needed_distributions(modules: set[str], box: list[str] = BOX_PACKAGES) -> dict[str, str]:
    """{distribution: installed version} of the ``modules`` not in the standard library, not ours and not on the
    box. A module two distributions provide (a namespace) brings both."""
    owners = metadata.packages_distributions()
    have = {normalized(b) for b in box}
    ours = {"rapo_ray", "benchmarks", "tests", "jobs", "sitecustomize"}
    out: dict[str, str] = {}
    for mod in sorted(modules - set(sys.stdlib_module_names) - ours):
        for dist in owners.get(mod, []):
            if normalized(dist) not in have:
                out[normalized(dist)] = metadata.version(dist)
    return out


def default_trace_commands(python: str, work: Path) -> list[list[str]]:
    """A GPU job's imports, here: a one-step GRPO job on a tiny bundled model with the torch engine in colocated mode
    (the path the box runs, on the CPU), and the packaged SmolLM2's conversion (the GGUF reader, the package)."""
    # (here only: importing rapo_ray imports Ray, which the box has once `box` has installed it)
    from rapo_ray.config import TINY_OVERRIDES, TINY_WARM_OVERRIDES

    job = [
        python, str(REPO / "jobs" / "train.py"), *TINY_OVERRIDES, *TINY_WARM_OVERRIDES, "algo.name=grpo",
        "resources.colocate=true", "trainer.total_steps=1", "trainer.eval_every=0", "run.progress=false",
        f"run.output_dir={work / 'runs'}", f"run.artifacts_dir={work / 'artifacts'}", "run.name=trace",
    ]  # fmt: skip
    convert = [  # into a folder of its own each time: a cached conversion imports nothing
        python,
        "-c",
        "import sys; from rapo_ray.model.gguf import ensure_converted, packaged_gguf; "
        f"ensure_converted(packaged_gguf('{PRESET}'), sys.argv[1], log=lambda *_: None)",
        str(work / "conversion"),
    ]
    return [job, convert]


def download_wheels(dists: dict[str, str], dest: Path, python_version: str = "3.12") -> list[Path]:
    """Each ``name==version`` as a binary wheel for CPython ``python_version`` on manylinux x86_64, no dependencies
    (the trace named every one needed). A distribution with no such wheel stops here, named."""
    dest.mkdir(parents=True, exist_ok=True)
    platforms = [a for p in PLATFORMS for a in ("--platform", p)]
    for name, version in sorted(dists.items()):
        cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "--implementation",
               "cp", "--python-version", python_version, *platforms, "-d", str(dest), f"{name}=={version}"]  # fmt: skip
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise SystemExit(f"no Python {python_version} manylinux wheel of {name}=={version}: {proc.stderr[-800:]}")
    return sorted(dest.glob("*.whl"))


# ---------------------------------------------------------------- loads of parts, and back


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(MB), b""):
            h.update(block)
    return h.hexdigest()


def pack(files: list[Path], out: Path, part_bytes: int, load_bytes: int) -> dict:
    """Split ``files`` into parts of at most ``part_bytes`` in folders ``out/load1``, ``out/load2``, ... of at most
    ``load_bytes`` each (parts in file order), with ``manifest.json`` in every load. Returns the manifest."""
    if part_bytes > load_bytes:
        raise ValueError(f"a part ({part_bytes} bytes) must fit in a load ({load_bytes} bytes)")
    if out.exists():
        shutil.rmtree(out)
    manifest: dict = {"files": [], "loads": 0}
    load, used = 1, 0
    for path in files:
        entry = {"name": path.name, "bytes": path.stat().st_size, "sha256": sha256_of(path), "parts": []}
        with open(path, "rb") as f:
            k = 0
            while True:
                chunk = f.read(part_bytes)
                if not chunk and k:
                    break
                if used + len(chunk) > load_bytes:
                    load, used = load + 1, 0
                part = f"{path.name}.part{k:03d}"
                (out / f"load{load}").mkdir(parents=True, exist_ok=True)
                (out / f"load{load}" / part).write_bytes(chunk)
                entry["parts"].append([f"load{load}", part])
                used += len(chunk)
                k += 1
                if not chunk:
                    break
        manifest["files"].append(entry)
    manifest["loads"] = load
    for n in range(1, load + 1):
        (out / f"load{n}").mkdir(parents=True, exist_ok=True)
        (out / f"load{n}" / "manifest.json").write_text(json.dumps(manifest, indent=1))
    return manifest


def unpack(src: Path, dest: Path) -> list[Path]:
    """Join the parts under ``src`` (its ``load*`` folders, as ``pack`` wrote them) into ``dest``, each file checked
    against the manifest's size and SHA-256. A missing load or part, or a file that does not match, stops with its
    name; nothing half-joined is left under its own name."""
    manifests = sorted(src.glob("load*/manifest.json"))
    if not manifests:
        raise SystemExit(f"{src}: no load*/manifest.json (carry the loads that `prepare` wrote)")
    manifest = json.loads(manifests[0].read_text())
    missing = [f"load{n}" for n in range(1, manifest["loads"] + 1) if not (src / f"load{n}").is_dir()]
    if missing:
        raise SystemExit(f"{src}: loads {missing} of {manifest['loads']} are not here (carry each load once)")
    dest.mkdir(parents=True, exist_ok=True)
    out = []
    for entry in manifest["files"]:
        tmp = dest / f".{entry['name']}.joining"
        with open(tmp, "wb") as f:
            for load, part in entry["parts"]:
                piece = src / load / part
                if not piece.is_file():
                    tmp.unlink()
                    raise SystemExit(f"{piece}: part of {entry['name']} is missing")
                f.write(piece.read_bytes())
        if tmp.stat().st_size != entry["bytes"] or sha256_of(tmp) != entry["sha256"]:
            tmp.unlink()
            raise SystemExit(f"{entry['name']}: the joined parts do not match the manifest (size or SHA-256)")
        tmp.rename(dest / entry["name"])
        out.append(dest / entry["name"])
    return out


# ---------------------------------------------------------------- on the box


def box_job_command(python: str, steps: int, out_dir: str, eval_size: int) -> list[str]:
    """The recipe on one GPU: GRPO, one learner rank and one torch engine sharing the GPU (colocate=auto turns on
    with one GPU in the cluster), bf16 on the GPU, a few steps and a small held-out set."""
    return [
        python, str(REPO / "jobs" / "train.py"), "--config", str(REPO / "configs" / "smollm2_arith.yaml"),
        "algo.name=grpo", "rollout.engine=torch", "learner.world_size=1", "rollout.num_workers=1",
        "resources.gpus_per_learner=1", "resources.gpus_per_rollout_worker=1", "resources.colocate=auto",
        "learner.bf16=true", f"trainer.total_steps={steps}", f"trainer.eval_size={eval_size}", "trainer.eval_every=0",
        f"run.output_dir={out_dir}", "run.name=gpu", f"run.artifacts_dir={out_dir}/artifacts", "run.progress=false",
    ]  # fmt: skip


def peak_gpu_memory(stop: threading.Event, result: dict, every_s: float = 0.5) -> None:
    """Poll nvidia-smi's memory.used (MiB, every process on the GPU) until ``stop``; the peak into ``result``."""
    while not stop.is_set():
        try:
            used = subprocess.run(
                ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                capture_output=True, text=True, timeout=10,
            ).stdout.split()  # fmt: skip
            if used:
                result["peak_mib"] = max(result.get("peak_mib", 0), int(used[0]))
        except (OSError, subprocess.TimeoutExpired, ValueError):
            result["error"] = "nvidia-smi did not answer"
        stop.wait(every_s)


def run_box(args) -> int:
    """Everything the box does: standard library only until the job starts (the box has no Ray before this)."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    wheels = unpack(Path(args.loads), Path(tempfile.mkdtemp(prefix="rapo_wheels_")))
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile", "--no-cache-dir",
         "--upgrade", "--target", SITE, *map(str, wheels)],
        check=True,
    )  # fmt: skip
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([SITE, str(REPO)]), PYTHONUNBUFFERED="1")
    memory: dict = {}
    stop = threading.Event()
    poller = threading.Thread(target=peak_gpu_memory, args=(stop, memory), daemon=True)
    poller.start()
    run_dir = Path(tempfile.mkdtemp(prefix="rapo_gpu_job_"))
    t0 = time.perf_counter()
    with open(out / "job.log", "w") as log:
        rc = subprocess.run(
            box_job_command(sys.executable, args.steps, str(run_dir), args.eval_size),
            cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=args.timeout_s,
        ).returncode  # fmt: skip
    stop.set()
    poller.join(5)
    report = {"exit": rc, "seconds": round(time.perf_counter() - t0, 1), "gpu_memory": memory, "wheels": len(wheels)}
    for name in ("metrics.jsonl", "summary.json", "config.yaml"):
        found = sorted(run_dir.glob(f"*/{name}"))
        if found:
            shutil.copy(found[0], out / name)
    (out / "gpu_job.json").write_text(json.dumps(report, indent=1))
    print(json.dumps(report), flush=True)
    return rc


# ---------------------------------------------------------------- here


def run_prepare(args) -> int:
    work = Path(args.work)
    tmp = work / "trace"
    for stale in (tmp / "runs", tmp / "conversion", work / "wheels"):  # (artifacts kept: the warm start is reused)
        shutil.rmtree(stale, ignore_errors=True)
    from rapo_ray.config.presets import PACKAGED_MODELS  # (here only, as in default_trace_commands)

    # the packaged model: found by find_spec and read as data (its GGUF file), never imported
    modules = trace_imports(default_trace_commands(sys.executable, tmp)) | {PACKAGED_MODELS[PRESET].module}
    dists = needed_distributions(modules)
    print(f"the job imported {len(modules)} top-level modules; {len(dists)} distributions the box lacks:", flush=True)
    for name, version in sorted(dists.items()):
        print(f"  {name}=={version}")
    wheels = download_wheels(dists, work / "wheels")
    manifest = pack(wheels, work / "loads", int(args.part_mb * MB), int(args.load_mb * MB))
    total = sum(f["bytes"] for f in manifest["files"])
    (work / "distributions.json").write_text(json.dumps(dists, indent=1))
    print(f"{len(wheels)} wheels, {total / MB:.1f} MiB in {manifest['loads']} loads under {work / 'loads'}")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    prep = sub.add_parser("prepare", help="here: trace, download and pack what the box lacks")
    prep.add_argument("--work", default=str(WORK), help="where the wheels and the loads go (git ignores .gpu_job)")
    prep.add_argument("--part-mb", type=float, default=27.0, help="largest part of a file, MiB")
    prep.add_argument(
        "--load-mb", type=float, default=54.0, help="largest load, MiB: one device call carries it and the tree (64)"
    )
    box = sub.add_parser("box", help="on the GPU box: join, check, install, run the recipe")
    box.add_argument("--loads", default=str(WORK / "loads"), help="the carried load folders' parent")
    box.add_argument("--steps", type=int, default=3)
    box.add_argument("--eval-size", type=int, default=20, help="held-out problems before and after")
    box.add_argument("--timeout-s", type=float, default=420.0, help="the job's limit (the device call's is 600 s)")
    box.add_argument("--out", default=os.environ.get("OUT", "/tmp/rapo_gpu_job_out"))
    args = ap.parse_args(argv)
    if args.cmd == "prepare":
        return run_prepare(args)
    return run_box(args)


if __name__ == "__main__":
    sys.exit(main())
