"""sweep-orphans: the scheduled backstop of teardown, and what the automation runs when a retrain dies."""

from __future__ import annotations

from prefect import flow

from tasks.sweep import sweep_orphaned_clusters


@flow(name="sweep-orphans", log_prints=True)
def sweep_orphans(include_alive: bool = False) -> list[str]:
    """Tear down every cluster whose run is no longer running; returns the names torn down.

    Args:
        include_alive: Also tear down clusters whose run is still alive (an emergency stop of everything).
    """
    return sweep_orphaned_clusters(include_alive)
