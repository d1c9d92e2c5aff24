"""provider slurm at a site whose slurmdbd enforces associations: tests/slurm_cluster.py with accounting (MariaDB,
slurmdbd, a slurmctld with AccountingStorageEnforce=associations, one slurmd), this user's association in account
`lab` on the site's cluster and, as one slurmdbd serving several clusters has, an association in `far` on another.

Plan refuses an account the user has no association for on this cluster (exit 2, one line naming the account, the
user and the accounts they have); an allocation charged to `lab` passes the plan's check, is accepted by the real
slurmctld and is recorded by slurmdbd under `lab`; what the real sbatch says of the accounts plan refuses (launch
without plan) is an InvalidRequestError.
"""

from __future__ import annotations

import getpass
import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from cloud_env import wait_for
from conftest import run_trainpipe
from slurm_cluster import ACCOUNT, CLUSTER_NAME, Site, SlurmCluster, slurm_cluster
from test_slurm_provider import DEADLINE_S, example_job, spec

from infra.compute.providers import InvalidRequestError, get_provider
from infra.job.plan import PlanError, check_site

ELSEWHERE = "elsewhere"  # another cluster of the same slurmdbd
FAR = "far"  # an account this user has on ELSEWHERE only
UNKNOWN = "no-such-lab"  # an account the database does not know


@pytest.fixture(scope="module")
def dbd_site() -> Iterator[SlurmCluster]:
    with slurm_cluster(Site(nodes=("gpu1",), accounting=True)) as cluster:
        print(f"test Slurm with slurmdbd started in {cluster.started_in_s:.2f}s")
        cluster.run("sacctmgr", "-i", "add", "cluster", ELSEWHERE)
        cluster.run("sacctmgr", "-i", "add", "account", FAR, f"cluster={ELSEWHERE}")
        cluster.run("sacctmgr", "-i", "add", "user", getpass.getuser(), f"account={FAR}", f"cluster={ELSEWHERE}")
        yield cluster


@pytest.fixture
def site(dbd_site: SlurmCluster, workspace: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[SlurmCluster]:
    """The module's site as this test's Slurm (SLURM_CONF); every job a test leaves is cancelled after it."""
    with dbd_site.for_test(monkeypatch) as test_site:
        yield test_site


def test_trainpipe_plan_refuses_an_account_the_user_has_not_on_this_cluster(site: SlurmCluster, workspace: Path,
                                                                            tmp_path: Path) -> None:
    user = getpass.getuser()
    env = example_job(site, workspace, tmp_path, steps=40)
    job = yaml.safe_load((tmp_path / "job.yaml").read_text())
    job["cluster"]["nodes"] = 1
    job["cluster"]["slurm"]["account"] = UNKNOWN
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    result = run_trainpipe("plan", str(tmp_path / "job.yaml"), env=env)
    assert result.returncode == 2, result.stdout + result.stderr
    said = [line for line in result.stderr.splitlines() if "cluster.slurm.account" in line]  # one line
    assert said == [f"error: cluster.slurm.account '{UNKNOWN}': {user} has no such account at the site: use one of "
                    f"{ACCOUNT}, root (sacctmgr show associations where users={user} clusters={CLUSTER_NAME})"], \
        result.stderr
    # An association on another cluster of the same slurmdbd is no account here (sbatch refuses it, below).
    with pytest.raises(PlanError, match=rf"account '{FAR}': {user} has no such account .*use one of {ACCOUNT}, root "):
        check_site(spec(tmp_path, nodes=1, account=FAR))
    assert site.job_ids() == []


def test_an_allocation_charged_to_the_users_account_is_accepted_and_accounted(site: SlurmCluster,
                                                                             tmp_path: Path) -> None:
    check_site(spec(tmp_path, nodes=1, account=ACCOUNT))
    provider = get_provider("slurm")
    cluster = provider.launch("tp-account", spec(tmp_path, nodes=1, account=ACCOUNT), "run-account")
    job_id = cluster.owner["job_id"]
    try:
        assert site.run("squeue", "-h", "-j", job_id, "-o", "%a|%T").stdout.split() == [f"{ACCOUNT}|RUNNING"]
    finally:
        provider.terminate("tp-account")
    assert site.job_ids() == []

    def ended_record() -> list[str] | None:
        """slurmdbd's account and state of the job once it has the job's end (it hears of it after squeue does)."""
        rows = [line.split("|") for line in
                site.run("sacct", "-nP", "-X", "-j", job_id, "-o", "Account,State").stdout.splitlines()]
        return rows[0] if rows and rows[0][1] not in ("PENDING", "RUNNING") else None

    wait_for(lambda: ended_record() is not None, DEADLINE_S, "slurmdbd's record of the job's end")
    assert ended_record() == [ACCOUNT, f"CANCELLED by {os.getuid()}"]

    # What the real sbatch says of the accounts plan refuses: the provider's InvalidRequestError, nothing left queued.
    for account in (UNKNOWN, FAR):
        refused = time.monotonic()
        with pytest.raises(InvalidRequestError, match="Invalid account or account/partition combination"):
            provider.launch("tp-account", spec(tmp_path, nodes=1, account=account), "run-account")
        print(f"sbatch --account={account} refused in {time.monotonic() - refused:.2f}s")
        assert site.job_ids() == []
