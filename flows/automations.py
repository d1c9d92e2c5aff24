"""Server-side teardown: automations that act when a retrain run dies where its own hooks cannot run.

Client-side hooks need a live process. When the process running a flow is killed with it (a SIGKILLed serve or
worker, a lost machine), the server only notices that the run's heartbeats stopped. The first automation marks
such a run Crashed; the second runs the sweep-orphans deployment whenever a retrain run is Crashed or Cancelled.
"""

from __future__ import annotations

from datetime import timedelta
from uuid import UUID

from prefect import get_client
from prefect.automations import Automation, ChangeFlowRunState, EventTrigger, Posture, RunDeployment
from prefect.client.schemas.objects import StateType

SILENT_RUNS = "trainpipe: retrain went silent -> Crashed"
DEAD_RUNS = "trainpipe: retrain Crashed or Cancelled -> sweep-orphans"
FLOW_RUNS = {"prefect.resource.id": "prefect.flow-run.*"}
OF_RETRAIN = {"prefect.resource.role": "flow", "prefect.resource.name": "retrain"}
FINAL_EVENTS = {f"prefect.flow-run.{state}" for state in ("Completed", "Failed", "Cancelled", "Crashed")}


def teardown_automations(sweep_deployment_id: UUID, silence_s: int) -> list[Automation]:
    silent = Automation(
        name=SILENT_RUNS,
        description=f"A retrain run that sent no heartbeat for {silence_s}s lost its process: mark it Crashed.",
        trigger=EventTrigger(
            posture=Posture.Proactive, match=FLOW_RUNS, match_related=OF_RETRAIN, for_each={"prefect.resource.id"},
            # After Running too: a process killed before its first heartbeat reached the server goes silent as well.
            after={"prefect.flow-run.Running", "prefect.flow-run.heartbeat"},
            expect={"prefect.flow-run.heartbeat", *FINAL_EVENTS},
            threshold=1, within=timedelta(seconds=silence_s)),
        actions=[ChangeFlowRunState(state=StateType.CRASHED,
                                    message=f"no heartbeat for {silence_s}s: its process is gone")],
    )
    dead = Automation(
        name=DEAD_RUNS,
        description="Tear down what a retrain run that ended without its own teardown left running.",
        trigger=EventTrigger(
            posture=Posture.Reactive, match=FLOW_RUNS, match_related=OF_RETRAIN,
            expect={"prefect.flow-run.Crashed", "prefect.flow-run.Cancelled"}, threshold=1),
        actions=[RunDeployment(source="selected", deployment_id=sweep_deployment_id, parameters={})],
    )
    return [silent, dead]


def _definition(automation: Automation) -> tuple[object, ...]:
    # Python mode, not JSON: the trigger's `after`, `expect` and `for_each` are sets, and a JSON dump lists a set in
    # its iteration order, which two equal sets need not share (it depends on the hash seed and insertion order).
    return (automation.description, automation.enabled, automation.trigger.model_dump(exclude={"id"}),
            [action.model_dump() for action in automation.actions])


def install(automations: list[Automation]) -> list[UUID]:
    """Create each automation, keeping one of the same name whose definition is unchanged.

    Keeping matters: a proactive trigger remembers which runs it is watching, so recreating it on every serve
    restart would forget exactly the run whose death caused the restart. A changed one is replaced, so
    restarting serve never leaves two that fire twice.
    """
    ids = []
    with get_client(sync_client=True) as client:
        for automation in automations:
            existing = client.read_automations_by_name(automation.name)
            kept = [old for old in existing if _definition(old) == _definition(automation)][:1]
            for old in existing:
                if old not in kept:
                    client.delete_automation(old.id)
            ids.append(kept[0].id if kept else automation.create().id)
    return ids
