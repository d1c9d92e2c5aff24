"""Delete the Azure VM this runs on, with the VM's own user-assigned managed identity: what a trainpipe node does as
it powers off.

An Azure VM whose guest powers itself off is only stopped, not deallocated: its compute goes on being billed (and its
disks, NIC and public IP with it) until someone deallocates or deletes it. So the custom data installs this program
and a systemd unit that runs it when the machine powers off (not on a reboot): the lease watchdog's `shutdown -h now`
then ends the VM for good, as on AWS. It asks the instance metadata service (IMDS) for a Resource Manager token of the
identity (`msi_res_id`: the VM may carry several), and for the VM's subscription, resource group and name, and
DELETEs the VM with `forceDeletion=true` (Azure skips the graceful power-off it would otherwise wait for); its OS
disk, NIC and public IP are created with deleteOption Delete and go with it. The identity needs
Microsoft.Compute/virtualMachines/delete on the VM: the custom role of examples/azure-self-delete-role.json (read and
delete of virtual machines, nothing else), assigned on the subscription (each cluster's resource group is created at
launch, so a role on the groups must be granted at a scope above them; Azure's role assignment conditions do not
cover Microsoft.Compute's actions, so no condition can narrow it to trainpipe's groups or tags). If the call
fails the node still powers off, and the sweeper deletes what is left (its heartbeat is gone).

Stdlib only and self-contained: the custom data copies this file verbatim onto the node, where nothing of trainpipe
may be installed yet. Run as `python3 azure_self_delete.py --identity RESOURCE_ID [--metadata URL] [--api URL]`.
"""

from __future__ import annotations

import argparse
import json
import sys
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

METADATA = "http://169.254.169.254"
API = "https://management.azure.com"
RESOURCE = "https://management.azure.com/"  # the audience of the token: Resource Manager
TOKEN_API_VERSION = "2018-02-01"
COMPUTE_API_VERSION = "2021-02-01"
# Microsoft.Compute's API version, the one the provider's azure-mgmt-compute uses (tests/test_azure_provider.py
# checks they agree).
VM_API_VERSION = "2026-04-01"
TIMEOUT_S = 10.0
# The custom role of examples/azure-self-delete-role.json: virtualMachines/read and /delete only. Virtual Machine
# Contributor would do too, but any process on the node can take the identity's token from IMDS, and that role is
# write and run-command on every VM of the subscription.
ROLE = "trainpipe node self-delete"
ROLE_FILE = "examples/azure-self-delete-role.json"


def _json(request: urllib.request.Request, opener: urllib.request.OpenerDirector | None = None) -> Any:
    with (opener or urllib.request.build_opener()).open(request, timeout=TIMEOUT_S) as reply:
        body = reply.read().decode()
    return json.loads(body) if body.strip() else {}


def imds(base: str, path: str, query: dict[str, str]) -> Any:
    url = f"{base.rstrip('/')}{path}?{urllib.parse.urlencode(query)}"
    # IMDS answers on the VM's own link only: never through a proxy the environment names.
    return _json(urllib.request.Request(url, headers={"Metadata": "true"}),
                 urllib.request.build_opener(urllib.request.ProxyHandler({})))


def delete_self(identity: str, metadata_url: str = METADATA, api_url: str = API) -> str:
    """Ask for this VM's deletion; returns the VM's resource path."""
    token = imds(metadata_url, "/metadata/identity/oauth2/token",
                 {"api-version": TOKEN_API_VERSION, "resource": RESOURCE, "msi_res_id": identity})["access_token"]
    compute = imds(metadata_url, "/metadata/instance/compute", {"api-version": COMPUTE_API_VERSION})
    quote = urllib.parse.quote
    vm = (f"/subscriptions/{quote(compute['subscriptionId'])}/resourceGroups/{quote(compute['resourceGroupName'])}"
          f"/providers/Microsoft.Compute/virtualMachines/{quote(compute['name'])}")
    url = f"{api_url.rstrip('/')}{vm}?api-version={VM_API_VERSION}&forceDeletion=true"
    _json(urllib.request.Request(url, method="DELETE", headers={"Authorization": f"Bearer {token}"}))
    return vm


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description="delete this Azure VM (trainpipe runs it as the node powers off)")
    parser.add_argument("--identity", required=True, help="the user-assigned managed identity's resource ID")
    parser.add_argument("--metadata", default=METADATA, help="instance metadata service base URL")
    parser.add_argument("--api", default=API, help="Azure Resource Manager endpoint")
    args = parser.parse_args(argv)
    fix = (f"grant identity {args.identity} the role '{ROLE}' ({ROLE_FILE} in trainpipe: virtualMachines/read and "
           "/delete) on the subscription; the sweeper deletes this VM otherwise")
    try:
        vm = delete_self(args.identity, args.metadata, args.api)
    except urllib.error.HTTPError as exc:
        detail = " ".join(exc.read().decode(errors="replace").split())[:300]
        print(f"trainpipe: deleting this VM failed: HTTP {exc.code} from {exc.url.split('?')[0]}: {detail}: {fix}",
              file=sys.stderr)
        return 1
    except (OSError, ValueError, KeyError, TypeError) as exc:
        print(f"trainpipe: deleting this VM failed: {exc!r}: {fix}", file=sys.stderr)
        return 1
    print(f"trainpipe: deleting this VM ({vm})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
