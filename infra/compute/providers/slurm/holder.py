"""The batch script of a trainpipe allocation: it holds the nodes while the run's job steps use them.

It runs on the allocation's first node and does three things:
- makes every node's workdir (data, ckpt, logs) with one job step across the nodes, removing the preemption notice
  and the syncer state (its stop request) an earlier allocation of the same cluster left there (a recovery's
  relaunch), and stamps it with the job's id (ALLOCATION_FILE); then writes READY_FILE in its own. The same step
  removes, beside it in the node's scratch, the workdirs of other trainpipe clusters whose stamped job has ended (an
  allocation ended by its lease or its walltime has no teardown to remove them, and they filled the scratch disk):
  never one whose job is pending or running, and none while slurmctld does not answer (unknown is not ended);
- turns the allocation's end into a preemption notice on every node: USR1 (sbatch --signal=B:USR1@N: N s before the
  walltime, or when preemption starts where the site sets preempt_send_user_signal) and SIGTERM (preemption or
  cancel, KillWait before SIGKILL) each write infra.node.preemption's notice file into every node's workdir, which
  the nodes' watchers act on (emergency checkpoint, sync). Where the site sends no early signal, the job hears of a
  preemption only by the SIGTERM at the end of the grace time, when no step can start any more to carry the notice
  to the other nodes: there the holder asks slurmctld (`scontrol show job`) every poll, and the PreemptTime
  slurmctld sets when the preemption starts is the notice, the grace time ahead;
- ends the allocation when the orchestrator has been silent for the lease TTL: the lease file in its node's workdir
  (renewed by the orchestrator's LeaseKeeper with the unix time) not renewed for ttl seconds, counted from the
  holder's start before the first renewal. The batch script's exit ends the job, and Slurm ends every step in it.
  The renewals are job steps, which slurmctld starts: a lease that goes stale while slurmctld does not answer (a
  restart, a reconfigure, a failover) says nothing of the orchestrator, so it counts again from the controller's
  return, for up to controller_outage_s of silence; past that the lease is judged as it stands. slurmctld is asked
  from half the TTL on, and an answer that was slow in coming counts as silence: an ask that spans the controller's
  return would otherwise judge the lease lapsed at once, its renewals still on their way.

Nothing secret is in the script: it is stored by slurmctld and shown by `scontrol write batch_script`.
"""

from __future__ import annotations

import shlex

from infra.compute.providers.slurm.config import NODE_PLACEHOLDER
from infra.node.preemption_notice import NOTICE_FILE
from infra.node.watchdog import LEASE_FILE

READY_FILE = ".allocation-ready"
ALLOCATION_FILE = ".allocation"  # in every node's workdir: the id of the job that made it, last
SYNC_SUBDIR = "sync"  # a node's syncer state: Node.sync_dir, relative to its workdir
HOLDER_LOG = "holder.log"  # in the first node's logs dir
POLL_S = 2
# The most one `scontrol show job` may take (its own MessageTimeout is 10 s by default, then it may retry).
ASK_S = 10
# A SIGTERM from Slurm is followed by SIGKILL after the site's KillWait (30 s by default): the notice's deadline.
TERM_NOTICE_S = 30
# An answer this slow is a controller that was not answering until then (it answers in well under a second).
SLOW_S = 3
# How long a silent slurmctld excuses a lease that is not renewed: a controller restart or failover takes a minute or
# two; a controller silent for longer no longer keeps the allocation of an orchestrator that may be gone.
CONTROLLER_OUTAGE_S = 600

_SCRIPT = r"""#!/bin/bash
# trainpipe allocation holder: cluster @CLUSTER@ (run @RUN@). Every node agent of the run is a job step in it.
export TP_WORKDIR_TEMPLATE=@TEMPLATE@
node_dir() { local d="${TP_WORKDIR_TEMPLATE//@PLACEHOLDER@/$1}"; printf '%s' "$d"; }
own=$(node_dir "$SLURMD_NODENAME")
mkdir -p "$own/logs"
exec >>"$own/logs/@HOLDER_LOG@" 2>&1
say() { echo "$(date -u +%FT%TZ) holder: $*"; }
say "job $SLURM_JOB_ID holds $SLURM_JOB_NODELIST (restart ${SLURM_RESTART_COUNT:-0})"
# A lease older than this start is the last allocation's (a relaunch on the same nodes, a rerun of the run id): it
# counts from here, so the orchestrator has a whole TTL to write this allocation's first one. A silent slurmctld
# moves it on (see below).
counted_from=$(date +%s)

# One job step on every node: its workdir. The steps that follow (the run's) overlap with this holder.
# A step's own node dir, in $d (never an empty template: that would make dirs at /).
node_dir_step='[ -n "$TP_WORKDIR_TEMPLATE" ] || exit 1; d="${TP_WORKDIR_TEMPLATE//@PLACEHOLDER@/$SLURMD_NODENAME}"'
# Beside $d: the workdirs of trainpipe clusters (tp-*, stamped) whose job is over. squeue names a live job's state;
# an ended one's is terminal, or unknown to slurmctld once purged ("Invalid job id"); any other failure keeps the dir.
sweep_ended='drop() { rm -rf -- "$other" && echo "removed $other: its job $job ended (${state:-gone})"; }
for other in "${d%/*}"/tp-*; do
  [ "$other" != "$d" ] && [ -f "$other/@ALLOCATION@" ] || continue
  job=$(cat "$other/@ALLOCATION@"); state=$(squeue -h -j "$job" -o %T 2>&1); asked=$?
  case "$asked:$state" in
    0:PENDING*|0:RUNNING*|0:SUSPENDED*|0:CONFIGURING*|0:COMPLETING*) ;;
    0:REQUEUE*|0:RESIZING*|0:SIGNALING*|0:STAGE_OUT*|0:STOPPED*) ;;
    0:|0:COMPLETED*|0:CANCELLED*|0:FAILED*|0:TIMEOUT*|0:PREEMPTED*) drop ;;
    0:NODE_FAIL*|0:OUT_OF_MEMORY*|0:BOOT_FAIL*|0:DEADLINE*|*"Invalid job id"*) drop ;;
    *) echo "kept $other: the state of its job $job is unknown ($state)" ;;
  esac
done; true'
every_node() { srun --overlap --export=ALL --nodes="$SLURM_JOB_NUM_NODES" --ntasks-per-node=1 "$@"; }
# A relaunch (a recovery) finds the same dirs with what the last allocation left: its notice must not end this one,
# nor its syncers' state (the stop request the last watcher wrote) stop this one's syncers at their start.
every_node --kill-on-bad-exit=1 bash -c "$node_dir_step"'; mkdir -p "$d/data" "$d/ckpt" "$d/logs" &&
  rm -rf "$d/@NOTICE@" "$d/.@NOTICE@.tmp" "$d/@SYNC@" && printf "%s\n" "$SLURM_JOB_ID" > "$d/@ALLOCATION@" &&
  '"$sweep_ended" \
  || { say "cannot make the nodes' workdirs"; exit 1; }
printf '%s\n' "$SLURM_JOB_ID" > "$own/@READY@"

noticed=""
notice() {  # reason, seconds left
  [ -n "$noticed" ] && return
  noticed=1
  export TP_NOTICE="{\"reason\": \"slurm: $1\", \"deadline\": $(( $(date +%s) + $2 )), \"source\": \"slurm\"}"
  say "notice: $1 ($2 s left)"
  every_node bash -c "$node_dir_step"'; printf "%s" "$TP_NOTICE" > "$d/.@NOTICE@.tmp" && mv -f "$d/.@NOTICE@.tmp" \
    "$d/@NOTICE@"' &
  # Where the step cannot start any more (the allocation is ending), this node's notice is still written.
  printf '%s' "$TP_NOTICE" > "$own/.@NOTICE@.tmp" && mv -f "$own/.@NOTICE@.tmp" "$own/@NOTICE@"
}
trap 'notice "USR1: the allocation ends (preemption or walltime)" @LEAD@' USR1
trap 'notice "SIGTERM: the allocation is being ended" @TERM_S@' TERM
# This job as slurmctld shows it, in $shown; fails when slurmctld does not answer. Bounded: a controller that stops
# answering must not keep the loop from judging the lease.
ask_controller() { shown=$(timeout @ASK_S@ scontrol -o show job "$SLURM_JOB_ID" 2>&1); }
# The preemption slurmctld has started for this job, in $preempted_at.
preemption_started() {
  ask_controller || return 1
  [[ "$shown" =~ PreemptTime=([0-9][0-9T:-]+) ]] || return 1
  preempted_at=${BASH_REMATCH[1]}
}
silent_since=""
# Whether slurmctld kept the lease's renewals (job steps, which it starts) from getting through: it did not answer
# within @ASK_S@ s, or only after @SLOW_S@ s or more (an ask that spanned its return: the renewals queued behind it
# too). The lease then counts again from now, for up to @OUTAGE@ s of silence in a row.
controller_excuses() {
  local asked answered now why
  asked=$(date +%s)
  ask_controller; answered=$?
  now=$(date +%s)
  if (( answered == 0 && now - asked < @SLOW_S@ )); then
    [ -z "$silent_since" ] || say "slurmctld answers again after $(( now - silent_since )) s"
    silent_since=""
    return 1
  fi
  if [ -z "$silent_since" ]; then
    silent_since=$asked
    (( answered == 0 )) && why="it answered only after $(( now - asked )) s" || why=${shown:-no answer within @ASK_S@ s}
    say "lease not renewed for $(( asked - renewed )) s while slurmctld does not answer (${why:0:200}): the lease" \
      "counts again from its return (up to @OUTAGE@ s of silence)"
  fi
  (( now - silent_since < @OUTAGE@ ))
}

while true; do
  sleep @POLL@ & wait $!
  if (( @ASK_PREEMPTION@ )) && [ -z "$noticed" ] && preemption_started; then
    notice "preempted (slurmctld's PreemptTime $preempted_at; this site sends no early signal)" @TERM_S@
  fi
  now=$(date +%s)
  renewed=$(cut -d. -f1 "$own/@LEASE@" 2>/dev/null)
  [[ "$renewed" =~ ^[0-9]+$ ]] && (( renewed >= counted_from )) || renewed=$counted_from
  if (( now - renewed > @TTL@ / 2 )) && controller_excuses; then
    counted_from=$(date +%s)
  elif (( now - renewed > @TTL@ )); then
    say "lease not renewed for $(( now - renewed )) s (ttl @TTL@ s): ending the allocation"
    exit 0
  fi
done
"""


def holder_script(cluster_name: str, run_id: str, workdir_template: str, ttl_s: float, signal_lead_s: int,
                  ask_preemption: bool, controller_outage_s: float = CONTROLLER_OUTAGE_S) -> str:
    """The batch script; workdir_template is a node's workdir with {node} where its Slurm name goes; ask_preemption:
    the site sends no early signal, so the holder asks slurmctld whether a preemption has started;
    controller_outage_s: the most slurmctld's silence excuses a lease that is not renewed."""
    values = {
        "@CLUSTER@": cluster_name, "@RUN@": run_id, "@TEMPLATE@": shlex.quote(workdir_template),
        "@PLACEHOLDER@": NODE_PLACEHOLDER.replace("{", r"\{").replace("}", r"\}"), "@HOLDER_LOG@": HOLDER_LOG,
        "@READY@": READY_FILE, "@ALLOCATION@": ALLOCATION_FILE, "@NOTICE@": NOTICE_FILE, "@SYNC@": SYNC_SUBDIR,
        "@LEASE@": LEASE_FILE,
        "@LEAD@": str(signal_lead_s),
        "@TERM_S@": str(TERM_NOTICE_S), "@POLL@": str(POLL_S), "@ASK_S@": str(ASK_S), "@SLOW_S@": str(SLOW_S),
        "@TTL@": str(int(ttl_s)),
        "@ASK_PREEMPTION@": "1" if ask_preemption else "0", "@OUTAGE@": str(int(controller_outage_s)),
    }
    script = _SCRIPT
    for key, value in values.items():
        script = script.replace(key, value)
    return script
