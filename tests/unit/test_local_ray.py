"""init_local_ray: Ray's own start-up timeout is tried again once; anything else is raised at once."""

from __future__ import annotations

import pytest
import ray

from rapo_ray.core.local_ray import init_local_ray


def test_a_start_up_timeout_is_tried_again_after_a_shutdown(monkeypatch):
    calls = []

    def fake_init(**kwargs):
        calls.append(("init", kwargs))
        if len([c for c in calls if c[0] == "init"]) == 1:
            raise Exception("The current node timed out during startup. This could happen because ...")
        return "context"

    monkeypatch.setattr(ray, "init", fake_init)
    monkeypatch.setattr(ray, "shutdown", lambda: calls.append(("shutdown", None)))
    assert init_local_ray(address="local", num_cpus=2) == "context"
    assert [c[0] for c in calls] == ["init", "shutdown", "init"] and calls[2][1] == {"address": "local", "num_cpus": 2}


def test_other_errors_and_a_second_timeout_are_raised(monkeypatch):
    monkeypatch.setattr(ray, "shutdown", lambda: None)

    def bad_address(**_):
        raise ValueError("address must be 'local' or host:port")

    monkeypatch.setattr(ray, "init", bad_address)
    with pytest.raises(ValueError, match="address must be"):
        init_local_ray(address="nowhere")

    def always_slow(**_):
        raise RuntimeError("Timed out waiting for file /tmp/ray/session_x/gcs_server_port_abc")

    monkeypatch.setattr(ray, "init", always_slow)
    with pytest.raises(RuntimeError, match="gcs_server_port"):
        init_local_ray(address="local")
