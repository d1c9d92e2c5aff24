"""Delete the GCE instance this runs on, with the instance's own service account: what a trainpipe node does as it
powers off.

GCE has no equivalent of EC2's instance-initiated shutdown behaviour `terminate`: a guest that powers itself off is
merely STOPPED (TERMINATED in the API), and its boot disk goes on being billed. (`scheduling.instanceTerminationAction:
DELETE` acts only on preemption and on a max run duration, which is fixed at launch and cannot follow a lease.) So
the startup script installs this program and a systemd unit that runs it when the machine powers off (not on a
reboot): the lease watchdog's `shutdown -h now` then ends the instance for good, as on AWS. It asks the metadata
server for a token, the project, the zone and its name, and calls instances.delete; the API deletes the instance
even while it is stopping. The service account needs compute.instances.delete on it (the default compute service
account has it through the Editor role; a custom one needs roles/compute.instanceAdmin.v1 or a role with that
permission). If the call fails the node still powers off, and the sweeper deletes what is left (its heartbeat is
gone).

Stdlib only and self-contained: the startup script copies this file verbatim onto the node, where nothing of
trainpipe may be installed yet. Run as `python3 gce_self_delete.py [--metadata URL] [--api URL]`.
"""

from __future__ import annotations

import argparse
import json
import sys
import urllib.error
import urllib.request

METADATA = "http://metadata.google.internal"
API = "https://compute.googleapis.com"
TIMEOUT_S = 10.0


def metadata(base: str, path: str) -> str:
    request = urllib.request.Request(f"{base}/computeMetadata/v1/{path}", headers={"Metadata-Flavor": "Google"})
    with urllib.request.urlopen(request, timeout=TIMEOUT_S) as reply:
        return reply.read().decode().strip()


def delete_self(metadata_url: str = METADATA, api_url: str = API) -> str:
    """Ask for this instance's deletion; returns the delete operation's name."""
    token = json.loads(metadata(metadata_url, "instance/service-accounts/default/token"))["access_token"]
    project = metadata(metadata_url, "project/project-id")
    zone = metadata(metadata_url, "instance/zone").rsplit("/", 1)[-1]  # projects/NUMBER/zones/ZONE
    name = metadata(metadata_url, "instance/name")
    url = f"{api_url.rstrip('/')}/compute/v1/projects/{project}/zones/{zone}/instances/{name}"
    request = urllib.request.Request(url, method="DELETE", headers={"Authorization": f"Bearer {token}"})
    with urllib.request.urlopen(request, timeout=TIMEOUT_S) as reply:
        return str(json.loads(reply.read().decode()).get("name", ""))


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description="delete this GCE instance (trainpipe runs it as the node powers off)")
    parser.add_argument("--metadata", default=METADATA, help="metadata server base URL")
    parser.add_argument("--api", default=API, help="Compute Engine API endpoint")
    args = parser.parse_args(argv)
    try:
        operation = delete_self(args.metadata, args.api)
    except urllib.error.HTTPError as exc:
        detail = exc.read().decode(errors="replace")[:300]
        print(f"trainpipe: deleting this instance failed: HTTP {exc.code}: {detail}: grant its service account "
              "compute.instances.delete; the sweeper deletes it otherwise", file=sys.stderr)
        return 1
    except (OSError, ValueError, KeyError) as exc:
        print(f"trainpipe: deleting this instance failed: {exc}: the sweeper deletes it instead", file=sys.stderr)
        return 1
    print(f"trainpipe: deleting this instance ({operation})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
