"""A plan handed from `trainpipe run` to the flow it starts in the same process.

The command plans while Prefect's server starts (bad input is one line, before any flow), then runs the flow, whose
plan task would list and check the dataset and the inputs all over again: it takes the command's plan instead. A plan
is taken once, and only by the run id and the job it was made for; a run started any other way (a deployment, a
test calling the flow) finds none and plans in the flow.
"""

from __future__ import annotations

import threading

from infra.job.plan import Plan
from infra.job.spec import JobSpec

_handed: dict[str, tuple[str, Plan]] = {}  # run id -> (the job it was planned for, as JSON; the plan)
_lock = threading.Lock()


def hand_over(job: JobSpec, plan: Plan) -> None:
    with _lock:
        _handed[plan.run_id] = (job.model_dump_json(), plan)


def take_handed(job: JobSpec, run_id: str) -> Plan | None:
    """The plan handed over for this run and job, once; None when there is none (or it was made for another job)."""
    with _lock:
        handed = _handed.pop(run_id, None)
    return handed[1] if handed is not None and handed[0] == job.model_dump_json() else None
