"""Reach a node over SSH (paramiko) through the same Runner interface as LocalRunner.

connection: the endpoint, its errors, the connect with host key checks, retries and keepalives, and the connections
shared by every runner of an endpoint; command: the wrapper a command runs under and its environment on stdin;
runner: SshRunner and SshProcess, commands and files on the node.

Host keys are verified against a pinned SHA256 fingerprint or a known_hosts file; an unknown or changed key is
refused, never accepted or added. Connections are shared by every runner of the same endpoint in this process (tasks
build a fresh runner per call), reconnect when they drop, and retry transient failures (a node still booting) with
backoff, logging each retry; authentication and host key failures are never retried.

A command runs on the node in its own session and process group under a small bash wrapper, so terminate() can
signal the whole group. Its environment travels over the channel's stdin, never on the command line: every user of
the node can read a process's command line (/proc/*/cmdline, ps) for as long as it runs, while its environment is
readable by its owner alone. The wrapper ignores SIGTERM itself, and so does the `tee` that copies the output to the log
on the node, so a command that handles SIGTERM (a trainer saving a last checkpoint) keeps a working stdout until it
exits. `tee -p` keeps writing the node's log when the orchestrator goes away, so node processes outlive a lost
connection the way local ones outlive a dead orchestrator; the lease watchdog ends them.
"""
