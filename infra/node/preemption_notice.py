"""Where a node learns it is about to be taken away: the cloud's metadata service, or a notice file.

AWS: IMDSv2 — a session token (PUT), then `spot/instance-action` (404 until EC2 schedules the stop, then
{"action": "terminate", "time": ...}) and the rebalance recommendation (an early, softer signal). GCP: the
metadata server's `instance/preempted` ("TRUE" once preemption started, about 30 s before the VM stops; the
guest also gets an ACPI shutdown, which reaches the trainer as SIGTERM through systemd). Azure: the instance
metadata service's Scheduled Events (`Preempt` naming this VM, at least 30 s before a Spot VM is evicted; the events
of an availability set are shown to every VM in it, so the node looks for its own name). Local and ssh nodes: a
notice file, written by the chaos injector the way a cloud would raise its flag.
"""

from __future__ import annotations

import json
import os
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass
from datetime import datetime
from email.utils import parsedate_to_datetime
from pathlib import Path

NOTICE_FILE = "preemption-notice.json"
AWS_IMDS = "http://169.254.169.254"
GCP_METADATA = "http://metadata.google.internal"
AZURE_IMDS = "http://169.254.169.254"
AZURE_EVENTS_API = "2020-07-01"
AZURE_NOTICE_S = 30.0  # the least notice Azure gives a Spot VM; NotBefore says when exactly
GCP_NOTICE_S = 30.0  # GCE stops a preempted VM about 30 s after it starts preempting
AWS_NOTICE_S = 120.0  # EC2's spot interruption notice


@dataclass(frozen=True)
class Notice:
    reason: str
    deadline: float  # unix time by which the node is gone
    source: str

    def to_json(self) -> str:
        return json.dumps(asdict(self))


class MetadataError(OSError):
    """The metadata service answered something other than what its documentation says."""


def _request(url: str, *, method: str = "GET", headers: dict[str, str], timeout: float) -> tuple[int, str]:
    request = urllib.request.Request(url, method=method, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=timeout) as reply:
            return reply.status, reply.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(errors="replace")


def aws_notice(base_url: str = AWS_IMDS, timeout: float = 2.0) -> tuple[Notice | None, bool]:
    """(the interruption notice or None, whether EC2 recommends rebalancing away from this instance)."""
    status, token = _request(f"{base_url}/latest/api/token", method="PUT",
                             headers={"X-aws-ec2-metadata-token-ttl-seconds": "300"}, timeout=timeout)
    if status != 200:
        raise MetadataError(f"{base_url}: IMDSv2 token request answered {status}: is IMDSv2 enabled on the instance?")
    auth = {"X-aws-ec2-metadata-token": token}
    status, body = _request(f"{base_url}/latest/meta-data/spot/instance-action", headers=auth, timeout=timeout)
    notice = None
    if status == 200:
        action = json.loads(body)
        deadline = datetime.fromisoformat(action["time"].replace("Z", "+00:00")).timestamp()
        notice = Notice(f"spot instance-action {action['action']}", deadline, "aws")
    elif status != 404:
        raise MetadataError(f"{base_url}: spot/instance-action answered {status}")
    status, _ = _request(f"{base_url}/latest/meta-data/events/recommendations/rebalance", headers=auth,
                         timeout=timeout)
    return notice, status == 200


def gcp_notice(base_url: str = GCP_METADATA, timeout: float = 2.0) -> Notice | None:
    status, body = _request(f"{base_url}/computeMetadata/v1/instance/preempted",
                            headers={"Metadata-Flavor": "Google"}, timeout=timeout)
    if status != 200:
        raise MetadataError(f"{base_url}: instance/preempted answered {status}")
    return Notice("gce preemption", time.time() + GCP_NOTICE_S, "gcp") if body.strip() == "TRUE" else None


def azure_notice(vm_name: str, base_url: str = AZURE_IMDS, timeout: float = 2.0) -> Notice | None:
    """The Scheduled Event `Preempt` that names this VM, if Azure has scheduled one. Asking also opts the VM in:
    Azure then shows events at least their notice period ahead."""
    status, body = _request(f"{base_url}/metadata/scheduledevents?api-version={AZURE_EVENTS_API}",
                            headers={"Metadata": "true"}, timeout=timeout)
    if status != 200:
        raise MetadataError(f"{base_url}: scheduledevents answered {status}")
    for event in json.loads(body).get("Events", []):
        if event.get("EventType") == "Preempt" and vm_name in event.get("Resources", []):
            not_before = event.get("NotBefore")
            deadline = parsedate_to_datetime(not_before).timestamp() if not_before else time.time() + AZURE_NOTICE_S
            return Notice(f"azure scheduled event Preempt {event.get('EventId', '')}".strip(), deadline, "azure")
    return None


def parse_notice(text: str | None) -> Notice | None:
    """A notice file's contents (None: no file)."""
    if text is None:
        return None
    try:
        return Notice(**json.loads(text))
    except (ValueError, TypeError):
        return None  # caught mid-write: it is written atomically, the next poll reads it whole


def read_notice(path: Path) -> Notice | None:
    try:
        return parse_notice(path.read_text())
    except FileNotFoundError:
        return None


def write_notice(path: Path, notice: Notice) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(notice.to_json())
    os.replace(tmp, path)
