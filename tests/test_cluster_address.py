"""Node-to-node traffic goes to the nodes' cluster addresses, never to the addresses trainpipe reaches them by: the
peer replicas' server, torchrun's rendezvous and TRAINPIPE_NODE_IPS, verify's netbench client and all-reduce bench;
and a cluster record keeps both (one written before the field reads its address as both)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from jobs import make_job

import infra.analysis.clusterbench as clusterbench
from infra.compute.providers import Cluster, Node
from infra.compute.spec import ClusterSpec
from infra.node.protocol import AllreduceBenchRequest, NetbenchRequest
from tasks.fanout import replica_fields
from tasks.train import TrainLaunch, node_context, torchrun_request

PUBLIC = ("203.0.113.1", "203.0.113.2")
PRIVATE = ("10.0.0.1", "10.0.0.2")


def cluster() -> Cluster:
    nodes = tuple(Node(name=f"tp-a-node-{rank}", rank=rank, address=PUBLIC[rank], cluster_address=PRIVATE[rank],
                       workdir=f"/w{rank}", data_dir=f"/w{rank}/data", ckpt_dir=f"/w{rank}/ckpt", python="python3")
                  for rank in range(2))
    return Cluster(name="tp-a", provider="aws", run_id="a", nodes=nodes, created_at=0.0)


def test_the_record_keeps_both_addresses_and_an_older_one_reads_its_address_as_both() -> None:
    made = cluster()
    assert Cluster.from_json(made.to_json()) == made
    older = json.loads(made.to_json())
    for node in older["nodes"]:
        del node["cluster_address"]
    assert [n.cluster_address for n in Cluster.from_json(json.dumps(older)).nodes] == list(PUBLIC)


def test_training_and_replicas_use_the_cluster_addresses(tmp_path: Path) -> None:
    made = cluster()
    job = make_job(tmp_path, "file:///data/ds")
    launch = TrainLaunch(checkpoint_url="file:///c", dataset_url="file:///data/ds", rendezvous_port=29500,
                         config_hash="h")
    for node in made.nodes:
        assert torchrun_request(job, made, node, launch).master_addr == PRIVATE[0]
        assert node_context(job, made, node, launch).node_ips == PRIVATE
        assert replica_fields(node)["replica_serve"] == node.cluster_address
    worker = AllreduceBenchRequest()
    assert clusterbench.torchrun_request(made, made.nodes[1], 1, 29501, worker).master_addr == PRIVATE[0]


def test_the_netbench_client_dials_the_cluster_address(monkeypatch: pytest.MonkeyPatch) -> None:
    sent: list[NetbenchRequest] = []

    class Dialled(Exception):
        pass

    def run(provider: Any, made: Cluster, node: Node, request: NetbenchRequest, *args: Any) -> Any:
        sent.append(request)
        raise Dialled

    monkeypatch.setattr(clusterbench, "_run", run)
    made = cluster()
    with pytest.raises(Dialled):
        clusterbench._client(None, made, made.nodes[0], made.nodes[1], 5201, ClusterSpec(nodes=2), lambda _: None)
    assert [(r.host, r.port) for r in sent] == [(PRIVATE[1], 5201)]
