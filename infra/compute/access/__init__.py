"""Node access: run commands on a node and move small files, whatever the node is (remote: local subprocess
runner; ssh: paramiko with pinned host keys; hostkeys: the keys made for cloud nodes; agent_env: the node agent's
environment of its own on a node; bootstrap: that environment made and the node's report).

May import: the shared infra modules (errors) and itself; providers build on it, never the other way round.
"""
