"""Starting a local Ray on a busy machine.

A local Ray's start waits a fixed time for its processes (30 s for the raylet to register with the GCS, a bounded
wait for the GCS's port file). On a loaded 2-core box that wait has run out while nothing was wrong (seen in a test
session and a benchmark: "The current node timed out during startup", "Timed out waiting for file
.../gcs_server_port_..."); a second start then succeeded. So such a timeout is tried again once, after shutting down
what the first try left; any other error is raised as it is.
"""

from __future__ import annotations

import logging

import ray

log = logging.getLogger("rapo_ray")

STARTUP_TIMEOUTS = ("timed out during startup", "Timed out waiting for file")


def init_local_ray(attempts: int = 2, **init_kwargs):
    """``ray.init(**init_kwargs)``, tried again (up to ``attempts`` in all) when Ray's own start-up wait runs out."""
    for attempt in range(1, attempts + 1):
        try:
            return ray.init(**init_kwargs)
        except Exception as exc:  # noqa: BLE001 - Ray raises a bare Exception or a RuntimeError for these
            if attempt == attempts or not any(text in str(exc) for text in STARTUP_TIMEOUTS):
                raise
            log.warning("starting a local Ray timed out (%s); trying again", str(exc).splitlines()[0])
            ray.shutdown()


__all__ = ["init_local_ray"]
