"""The Nebius API as the provider calls it: one SDK channel (built on first use, credentials from the SDK's own
sources), every call repeated with logged backoff while it fails transiently under one idempotency key, operations
awaited to their end, lists read page by page, and where clusters are looked for (the project of each region).

Settings of the machine that runs trainpipe (a sweeper elsewhere needs them as much as a launch):
- TRAINPIPE_NEBIUS_PROJECTS: `region=project-id,...`, the project each region's clusters live in (a Nebius project
  belongs to one region).
- Credentials, in the SDK's order: TRAINPIPE_NEBIUS_CREDENTIALS_FILE (a service account's credentials.json, as the
  SDK's `credentials_file_name` reads it), else NEBIUS_IAM_TOKEN (the SDK's own environment bearer), else the nebius
  CLI's profile (~/.nebius/config.yaml). Never a command-line argument.
- TRAINPIPE_NEBIUS_ENDPOINT: one address for every service (host:port over TLS; http://host:port without TLS, for a
  local stand-in); none: the SDK's own resolution (<service>.api.nebius.cloud:443).
"""

from __future__ import annotations

import os
import threading
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

from infra.compute.providers.nebius.errors import (
    NO_CREDENTIALS_FIX,
    AuthError,
    InvalidRequestError,
    LaunchError,
    classify,
    describe,
    is_not_found,
    is_sdk_error,
    is_transient,
)
from infra.compute.providers.operations import call_retrying, wait_done

T = TypeVar("T")

PROJECTS_ENV = "TRAINPIPE_NEBIUS_PROJECTS"
CREDENTIALS_ENV = "TRAINPIPE_NEBIUS_CREDENTIALS_FILE"
TOKEN_ENV = "NEBIUS_IAM_TOKEN"  # the SDK's own (nebius.base.constants.TOKEN_ENV)
ENDPOINT_ENV = "TRAINPIPE_NEBIUS_ENDPOINT"
CLI_CONFIG = Path("~/.nebius/config.yaml")
USER_AGENT = "trainpipe/1"
API_ATTEMPTS = 5
RETRY_FIRST_S = 1.0
CALL_TIMEOUT_S = 60.0
WAIT_S = 900.0  # for an operation to finish: an 8-GPU VM can take minutes to be created
# Between polls of an operation or of instances starting: from POLL_FIRST_S, doubling up to POLL_MAX_S (a GPU
# cluster or a label update is done in well under a second; an 8-GPU VM takes minutes). Tests shorten both.
POLL_FIRST_S = 0.2
POLL_MAX_S = 3.0
PAGE_SIZE = 100


def _transient(exc: BaseException) -> bool:
    """An SDK failure a repeat of the same call may get past (anything else is not the API's answer: raised)."""
    return is_sdk_error(exc) and is_transient(exc)


def parse_projects(text: str) -> dict[str, str]:
    """`region=project-id,...` → {region: project id}; a malformed entry is an error naming it."""
    projects = {}
    for entry in (e.strip() for e in text.split(",")):
        if not entry:
            continue
        region, _, project = entry.partition("=")
        if not region.strip() or not project.strip():
            raise InvalidRequestError(f"nebius: {PROJECTS_ENV} entry {entry!r}: write region=project-id (e.g. "
                                      "eu-north1=project-e00abc123)")
        projects[region.strip()] = project.strip()
    return projects


class NebiusApi:
    """The provider's API plumbing (a base of NebiusProvider, whose constructor calls _init_api)."""

    def _init_api(self, projects: dict[str, str] | None, endpoint: str | None, credentials: Any) -> None:
        self._projects = projects if projects is not None else parse_projects(os.environ.get(PROJECTS_ENV, ""))
        self._endpoint = endpoint if endpoint is not None else os.environ.get(ENDPOINT_ENV) or None
        self._credentials = credentials  # anything the SDK's `credentials` takes; None: its own sources
        self._sdk: Any = None
        self._sdk_lock = threading.Lock()
        self._clients: dict[str, Any] = {}

    # -- where ----------------------------------------------------------------------------------------------------

    def project(self, region: str) -> str:
        project = self._projects.get(region)
        if not project:
            raise InvalidRequestError(f"nebius: no project for region {region}: add {region}=project-id to "
                                      f"{PROJECTS_ENV} (the project's id is in the console or `nebius iam project "
                                      "list`)")
        return project

    def projects(self) -> dict[str, str]:
        return dict(self._projects)

    # -- the SDK ----------------------------------------------------------------------------------------------------

    def _has_credentials(self) -> bool:
        """Whether the SDK could find credentials, decided locally (nothing is asked of the network)."""
        if self._credentials is not None or os.environ.get(CREDENTIALS_ENV) or os.environ.get(TOKEN_ENV):
            return True
        return CLI_CONFIG.expanduser().is_file()

    def sdk(self) -> Any:
        """The SDK channel, built on first use: every service at TRAINPIPE_NEBIUS_ENDPOINT when set."""
        with self._sdk_lock:
            if self._sdk is None:
                self._sdk = self._build_sdk()
            return self._sdk

    def _build_sdk(self) -> Any:
        from nebius.base.options import INSECURE
        from nebius.base.resolver import Constant
        from nebius.sdk import SDK

        options: dict[str, Any] = {"user_agent_prefix": USER_AGENT}
        if self._endpoint:
            insecure = self._endpoint.startswith("http://")
            address = self._endpoint.split("://", 1)[-1].rstrip("/")
            options["resolver"] = Constant(address)
            if insecure:
                options["address_options"] = {address: [(INSECURE, True)]}
        credentials_file = os.environ.get(CREDENTIALS_ENV)
        if self._credentials is not None:
            options["credentials"] = self._credentials
        elif credentials_file:
            if not Path(credentials_file).expanduser().is_file():
                raise AuthError(f"nebius: {CREDENTIALS_ENV}={credentials_file} is not a file: {NO_CREDENTIALS_FIX}")
            options["credentials_file_name"] = str(Path(credentials_file).expanduser())
        elif not os.environ.get(TOKEN_ENV) and CLI_CONFIG.expanduser().is_file():
            from nebius.aio.cli_config import Config

            options["config_reader"] = Config()
        elif not os.environ.get(TOKEN_ENV):
            raise AuthError(f"nebius: no credentials: {NO_CREDENTIALS_FIX}")
        return SDK(**options)

    def client(self, kind: str) -> Any:
        """The SDK's client of one service: instances, gpu_clusters, subnets."""
        if kind not in self._clients:
            if kind == "subnets":
                from nebius.api.nebius.vpc.v1 import SubnetServiceClient as cls
            elif kind == "gpu_clusters":
                from nebius.api.nebius.compute.v1 import GpuClusterServiceClient as cls
            else:
                from nebius.api.nebius.compute.v1 import InstanceServiceClient as cls
            self._clients[kind] = cls(self.sdk())
        return self._clients[kind]

    # -- calls --------------------------------------------------------------------------------------------------

    def _api(self, doing: str, call: Callable[..., Any], attempts: int = API_ATTEMPTS,
             timeout_s: float = CALL_TIMEOUT_S) -> Any:
        """One call (call(**request kwargs) returns the SDK's request), repeated with backoff while it fails
        transiently, under one idempotency key so that a repeat of an accepted call has no second effect. The SDK's
        own retries are off: these are logged, and bounded by the run's cancellation."""
        key = str(uuid.uuid4())
        return call_retrying(
            lambda: call(metadata=[("x-idempotency-key", key)], timeout=timeout_s, retries=1).wait(),
            _transient, describe, f"nebius: {doing}", attempts, RETRY_FIRST_S)

    def _get(self, doing: str, call: Callable[..., Any]) -> Any | None:
        """A Get: None when there is no such resource."""
        try:
            return self._api(doing, call)
        except Exception as exc:
            if is_sdk_error(exc) and is_not_found(exc):
                return None
            raise

    def _call(self, doing: str, action: Callable[[], T]) -> T:
        """action(), its SDK failures as the launch error that says what to do."""
        try:
            return action()
        except LaunchError:
            raise
        except Exception as exc:
            if is_sdk_error(exc):
                raise classify(exc, doing) from None
            raise

    def _finish(self, operation: Any, doing: str) -> str:
        """Wait for an operation to end; its resource id. Failed: the launch error it means."""
        wait_done(operation, lambda op: op.done(), lambda op: self._refresh(op, doing),
                  f"nebius: {doing}: operation {operation.id}", WAIT_S, POLL_FIRST_S, POLL_MAX_S)
        if not operation.successful():
            from nebius.aio.operation import OperationError

            raise classify(OperationError(operation), doing)
        return str(operation.resource_id)

    def _refresh(self, operation: Any, doing: str) -> Any:
        """The operation, updated in place (the SDK's operation refreshes itself)."""
        call_retrying(lambda: operation.sync_update(timeout=CALL_TIMEOUT_S), _transient, describe,
                      f"nebius: {doing}: polling operation {operation.id}", API_ATTEMPTS, RETRY_FIRST_S)
        return operation

    def _pages(self, doing: str, list_call: Callable[[Any], Callable[..., Any]], request: Any,
               attempts: int = API_ATTEMPTS, timeout_s: float = CALL_TIMEOUT_S) -> Iterator[Any]:
        """Every item of a List, page by page (list_call(request) → the call _api makes)."""
        while True:
            response = self._api(doing, list_call(request), attempts, timeout_s)
            yield from response.items
            if not response.next_page_token:
                return
            request.page_token = response.next_page_token
