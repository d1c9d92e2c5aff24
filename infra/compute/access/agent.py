"""The one client of the node protocol: sends any request (infra.node.protocol) to a node through its runner.

The request and the command's environment (store credentials, the job's secrets, per-run peer keys) travel in the
environment, on the channel the runner has for it; the command line names only the command.
"""

from __future__ import annotations

from collections.abc import Mapping

from infra.compute.access.remote import LineSink, Process, Runner, RunResult
from infra.node.protocol import NodeRequest


class NodeAgent:
    """A node's agent, reached through the cluster's runner. env: what every command sent to it gets (the job's
    secrets and store credentials); a call's own env (a stage's peer keys) is added to it."""

    def __init__(self, runner: Runner, python: str, env: Mapping[str, str] | None = None) -> None:
        self.runner, self.python, self.env = runner, python, dict(env or {})

    @property
    def node_name(self) -> str:
        return self.runner.node_name

    def _environment(self, request: NodeRequest, env: Mapping[str, str] | None) -> dict[str, str]:
        return request.environment({**self.env, **(env or {})})

    def run(self, request: NodeRequest, *, timeout: float | None = None, on_line: LineSink | None = None,
            check: bool = True, env: Mapping[str, str] | None = None, cwd: str | None = None) -> RunResult:
        """Run the request's command to its end (RemoteError names the node and the command when it fails)."""
        return self.runner.run(request.command_line(self.python), env=self._environment(request, env),
                               timeout=timeout, on_line=on_line, check=check, cwd=cwd)

    def start(self, request: NodeRequest, *, on_line: LineSink | None = None, log_path: str | None = None,
              env: Mapping[str, str] | None = None, cwd: str | None = None) -> Process:
        """Start the request's command in the background (a sidecar: the caller watches the Process)."""
        return self.runner.start(request.command_line(self.python), env=self._environment(request, env),
                                 on_line=on_line, log_path=log_path, cwd=cwd)
