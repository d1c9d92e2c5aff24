"""Chaos: the job's `chaos:` section (tests and drills only) takes nodes away during training, the way a cloud
reclaims a spot instance, so the flow's recovery can be exercised on the local and ssh providers.

Kept out of the train task so production training reads without it; the task arms it through one call, which does
nothing for a job without a `chaos:` section. The node side is infra.node.chaos; firing and detection are
PreemptionWatch's, which treats an injected preemption like a real one.
"""

from __future__ import annotations

from infra.compute.providers import Node
from infra.job.spec import JobSpec
from infra.lifecycle.preemption_watch import PreemptionWatch
from infra.node.protocol import ChaosRequest


def chaos_request(node: Node, trigger: str, notice_s: float) -> ChaosRequest:
    """The node's chaos injector: it waits for the trigger file, then gives notice and takes the node away."""
    return ChaosRequest(trigger=trigger, workdir=node.workdir, notice_s=notice_s)


def arm_chaos(job: JobSpec, attempt: int, watch: PreemptionWatch) -> None:
    """Start the injector on each node this attempt's chaos events preempt (each event names its attempt)."""
    if job.chaos is None:
        return
    watch.arm([event for event in job.chaos.preempt if event.attempt == attempt], chaos_request)
