"""A simulated EC2 control plane: a real `moto_server` process on a free loopback port.

moto 5 has no placement groups, so the server started here adds CreatePlacementGroup, DescribePlacementGroups and
DeletePlacementGroup to moto's EC2 backend (in memory, with tags, EC2's error codes), and RunInstances places an
instance in the group its Placement names (refused, as by EC2, when there is no such group), which DescribeInstances
then shows. Two more of EC2's ways are
added on request (moto_ec2's arguments): public addresses from a given prefix (where tests run a stand-in for the
instances' machines, tests/cloud_nodes.py) and private (subnet) addresses from another, so that a node-to-node
service bound to the wrong one is seen (tests/cloud_nodes.py), and instances that stay `shutting-down` for a while after
TerminateInstances, as EC2's do, before `terminated`. An outage of the instance reads the run's preemption watch
makes (DescribeInstances, DescribeSpotInstanceRequests) is started with Ec2Server.start_outage (tests/outage.py):
EC2's server errors, then its throttling; the test's own eyes (OBSERVER_KEY) are answered throughout.
AWS's public SSM parameters under /aws/service/deeplearning (the
Deep Learning AMIs), which moto does not ship and refuses to have put, can be published per region (public_parameters).
Everything else is moto's.
Run as a script it is the server itself: `python tests/aws_server.py PORT`.
"""

from __future__ import annotations

import copy
import itertools
import json
import os
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from outage import ERRORS, THROTTLED, Outage
from servers import _serving, free_port

ACCOUNT_KEY = "AKIAIOSFODNN7EXAMPLE"  # moto accepts any key pair; a normal-looking one keeps signing honest
ACCOUNT_SECRET = "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY"
# The key of the test's own reads (the stand-ins' view of the instances, what is left): an outage is the product's,
# not the test's. moto puts any key in its default account, so this one sees the same instances.
OBSERVER_KEY = "AKIAIOSFODNN7OBSERVE"


@dataclass(frozen=True)
class Ec2Server:
    endpoint: str
    outage_file: Path | None = None

    def start_outage(self, window_s: float) -> Outage:
        """From now, the watch's reads fail for window_s: 5xx for the first half, throttled for the second."""
        assert self.outage_file is not None, "a server started by moto_ec2 has an outage file"
        outage = Outage.lasting(window_s)
        outage.write(self.outage_file)
        return outage

    def env(self) -> dict[str, str]:
        """What boto3 needs to reach the simulated EC2 (and only EC2) with credentials that moto accepts."""
        return {"AWS_ENDPOINT_URL_EC2": self.endpoint, "AWS_ACCESS_KEY_ID": ACCOUNT_KEY,
                "AWS_SECRET_ACCESS_KEY": ACCOUNT_SECRET, "AWS_DEFAULT_REGION": "us-east-1",
                "AWS_EC2_METADATA_DISABLED": "true"}


PUBLIC_IP_PREFIX_ENV = "TRAINPIPE_TEST_EC2_PUBLIC_IP_PREFIX"
PRIVATE_IP_PREFIX_ENV = "TRAINPIPE_TEST_EC2_PRIVATE_IP_PREFIX"
SHUTTING_DOWN_ENV = "TRAINPIPE_TEST_EC2_SHUTTING_DOWN_S"
PUBLIC_PARAMETERS_ENV = "TRAINPIPE_TEST_SSM_PUBLIC_PARAMETERS"  # JSON {region: {name: value}}
OUTAGE_FILE_ENV = "TRAINPIPE_TEST_EC2_OUTAGE_FILE"  # tests/outage.py's phases, replaced whole by start_outage


@contextmanager
def moto_ec2(log_dir: Path, public_ip_prefix: str | None = None, shutting_down_s: float = 0.0,
             private_ip_prefix: str | None = None,
             public_parameters: dict[str, dict[str, str]] | None = None) -> Iterator[Ec2Server]:
    """public_ip_prefix: instances get public addresses prefix+1, prefix+2, ... (e.g. "127.77.1."); private_ip_prefix:
    their subnet addresses the same way (e.g. "127.79.1."); shutting_down_s: how long a terminated instance stays
    shutting-down; public_parameters: AWS's public SSM parameters by region ({region: {name: value}})."""
    port = free_port()
    log_dir.mkdir(parents=True, exist_ok=True)
    outage_file = log_dir / f"outage-{port}.json"
    env = {**os.environ, SHUTTING_DOWN_ENV: str(shutting_down_s),
           PUBLIC_PARAMETERS_ENV: json.dumps(public_parameters or {}), OUTAGE_FILE_ENV: str(outage_file)}
    if public_ip_prefix:
        env[PUBLIC_IP_PREFIX_ENV] = public_ip_prefix
    if private_ip_prefix:
        env[PRIVATE_IP_PREFIX_ENV] = private_ip_prefix
    with _serving([sys.executable, str(Path(__file__).resolve()), str(port)], port, log_dir / f"moto-{port}.log",
                  env=env):
        yield Ec2Server(f"http://127.0.0.1:{port}", outage_file)


def _public_ips_from(prefix: str) -> None:
    from moto.ec2.models import elastic_network_interfaces

    numbers = itertools.count(1)
    elastic_network_interfaces.random_public_ip = lambda: f"{prefix}{next(numbers)}"


def _private_ips_from(prefix: str) -> None:
    """Every subnet hands out prefix+1, prefix+2, ...: one sequence for the whole server, so addresses never repeat
    (EC2's come from the subnet's CIDR; a prefix on loopback is where the stand-ins can listen)."""
    from moto.ec2.models.subnets import Subnet

    numbers = itertools.count(1)

    def available(self: Any, instance: Any) -> str:
        address = f"{prefix}{next(numbers)}"
        self._subnet_ips[address] = instance
        return address

    Subnet.get_available_subnet_ip = available


def _slow_shutdown(seconds: float) -> None:
    from moto.ec2.models.instances import Instance

    terminate = Instance.terminate

    def shutting_down(self: Any) -> Any:
        if self._state.name in ("shutting-down", "terminated"):
            return copy.copy(self._state)  # EC2 takes a repeated TerminateInstances as a no-op
        previous = terminate(self)
        self._state.name, self._state.code = "shutting-down", 32

        def ended() -> None:
            self._state.name, self._state.code = "terminated", 48

        timer = threading.Timer(seconds, ended)
        timer.daemon = True
        timer.start()
        return previous

    Instance.terminate = shutting_down


def _publish_public_parameters(by_region: dict[str, dict[str, str]]) -> None:
    """AWS's own parameters, as moto loads its bundled ones: on the first read of a region's parameters."""
    from moto.ssm.models import Parameter, ParameterDict

    check = ParameterDict._check_loading_status

    def loading(self: Any, key: str) -> None:
        check(self, key)
        if not getattr(self, "trainpipe_public_loaded", False):
            self.trainpipe_public_loaded = True
            for name, value in by_region.get(self.region_name, {}).items():
                dict.setdefault(self, name, []).append(Parameter(
                    account_id=self.account_id, name=name, value=value, parameter_type="String", description=None,
                    allowed_pattern=None, keyid=None, last_modified_date=0.0, version=1, data_type="aws:ec2:image"))

    ParameterDict._check_loading_status = loading


def _add_placement_groups() -> None:
    from moto.core.responses import ActionResult, EmptyResult
    from moto.ec2.exceptions import EC2ClientError
    from moto.ec2.responses import EC2Response

    groups: dict[tuple[str, str], dict[str, dict[str, Any]]] = {}

    def _store(self: Any) -> dict[str, dict[str, Any]]:
        return groups.setdefault((self.current_account, self.region), {})

    def create_placement_group(self: Any) -> ActionResult:
        name = self._get_param("GroupName")
        store = _store(self)
        if name in store:
            raise EC2ClientError("InvalidPlacementGroup.Duplicate", f"The Placement Group '{name}' already exists.")
        tags = self._parse_tag_specification("placement-group").get("placement-group", {})
        store[name] = {"GroupName": name, "GroupId": f"pg-{len(groups) + len(store):017x}", "State": "available",
                       "Strategy": self._get_param("Strategy"), "Tags": [{"Key": k, "Value": v}
                                                                         for k, v in tags.items()]}
        return ActionResult({"PlacementGroup": store[name]})

    def describe_placement_groups(self: Any) -> ActionResult:
        names = self._get_param("GroupNames", [])
        store = _store(self)
        for name in names:
            if name not in store:
                raise EC2ClientError("InvalidPlacementGroup.Unknown", f"The Placement Group '{name}' is unknown.")
        found = [g for g in store.values() if not names or g["GroupName"] in names]
        for key, values in self._filters_from_querystring().items():
            if key.startswith("tag:"):
                found = [g for g in found if any(t["Key"] == key[4:] and t["Value"] in values for t in g["Tags"])]
            elif key == "group-name":
                found = [g for g in found if g["GroupName"] in values]
            else:
                raise EC2ClientError("InvalidParameterValue", f"The filter '{key}' is invalid")
        return ActionResult({"PlacementGroups": found})

    def delete_placement_group(self: Any) -> ActionResult:
        name = self._get_param("GroupName")
        if _store(self).pop(name, None) is None:
            raise EC2ClientError("InvalidPlacementGroup.Unknown", f"The Placement Group '{name}' is unknown.")
        return EmptyResult()

    run = EC2Response.run_instances

    def run_instances(self: Any) -> ActionResult:
        name = self._get_param("Placement.GroupName")
        if name and name not in _store(self):
            raise EC2ClientError("InvalidPlacementGroup.Unknown", f"The Placement Group '{name}' is unknown.")
        result = run(self)
        for instance in result.result.instances:
            instance.placement.group_name = name or ""
        return result

    EC2Response.run_instances = run_instances
    EC2Response.create_placement_group = create_placement_group
    EC2Response.describe_placement_groups = describe_placement_groups
    EC2Response.delete_placement_group = delete_placement_group


# EC2's answers while it is out, by phase: (HTTP status, code, message). EC2 throttles with HTTP 503 and
# RequestLimitExceeded, not 429 (botocore retries it as throttling); its server errors are InternalError (500) and
# Unavailable (503), alternated each half second here so that both are seen.
_OUTAGE_ANSWERS = {ERRORS: ((500, "InternalError", "An internal error has occurred."),
                            (503, "Unavailable", "The server is overloaded and can't handle the request.")),
                   THROTTLED: ((503, "RequestLimitExceeded", "Request limit exceeded."),)}


def _outage_of_reads(outage_file: Path) -> None:
    from moto.ec2.responses import EC2Response

    def failing(read: Any) -> Any:
        def answer(self: Any) -> Any:
            phase = Outage.read(outage_file).phase()
            if phase is None or OBSERVER_KEY in self.headers.get("Authorization", ""):
                return read(self)
            answers = _OUTAGE_ANSWERS[phase]
            status, code, message = answers[int(time.time() * 2) % len(answers)]
            body = (f'<?xml version="1.0" encoding="UTF-8"?>\n<Response><Errors><Error><Code>{code}</Code>'
                    f"<Message>{message}</Message></Error></Errors><RequestID>{uuid.uuid4()}</RequestID></Response>")
            return body, {"status": status}

        return answer

    EC2Response.describe_instances = failing(EC2Response.describe_instances)
    EC2Response.describe_spot_instance_requests = failing(EC2Response.describe_spot_instance_requests)


if __name__ == "__main__":
    _add_placement_groups()
    if os.environ.get(OUTAGE_FILE_ENV):
        _outage_of_reads(Path(os.environ[OUTAGE_FILE_ENV]))
    if json.loads(os.environ.get(PUBLIC_PARAMETERS_ENV) or "{}"):
        _publish_public_parameters(json.loads(os.environ[PUBLIC_PARAMETERS_ENV]))
    if os.environ.get(PUBLIC_IP_PREFIX_ENV):
        _public_ips_from(os.environ[PUBLIC_IP_PREFIX_ENV])
    if os.environ.get(PRIVATE_IP_PREFIX_ENV):
        _private_ips_from(os.environ[PRIVATE_IP_PREFIX_ENV])
    if float(os.environ.get(SHUTTING_DOWN_ENV) or 0) > 0:
        _slow_shutdown(float(os.environ[SHUTTING_DOWN_ENV]))
    from moto.server import main

    main(["-H", "127.0.0.1", "-p", sys.argv[1]])
