#!/bin/sh
# Slurm HealthCheckProgram: drains this node while sustain judges one of its devices degraded or
# unhealthy (docs/health.md, "Slurm"). In slurm.conf:
#   HealthCheckProgram=/opt/sustain/deploy/slurm/sustain-healthcheck.sh
#   HealthCheckInterval=60
#   HealthCheckNodeState=ANY
# The exit status of `sustain health --summary` is the verdict:
#   1  a device is degraded or unhealthy: drain the node with Reason="sustain: <summary>";
#   0  every device is healthy: resume the node, but only if sustain drained it (its reason
#      starts with "sustain:") and the verdict is live (a summary from the archive ends with
#      "(archive, AGE old)": the agent is not answering, so nothing is resumed on it);
#      another tool's drain is never undone;
#   *  no verdict (2: unknown: the agent unreachable and nothing archived, evidence older
#      than health.max_evidence_age_seconds, a device not sampled or a stalled sampler;
#      124: timed out; 127: no sustain): a line in syslog, no change to the node: a drained
#      node stays drained.
# A node another tool drained keeps that tool's reason; sustain drains it on a later run, once
# that tool has resumed it.
# Environment: SUSTAIN (the sustain command, default /opt/sustain/.venv/bin/sustain),
# SUSTAIN_HEALTH_TIMEOUT (seconds, default 30: slurmd kills a health check after 60 s),
# SLURMD_NODENAME (default: `hostname -s`), SUSTAIN_CONFIG (default: /etc/sustain/sustain.toml
# where it exists, the systemd install's: its exporter.listen is where the agent is asked).
set -u

if [ -z "${SUSTAIN_CONFIG:-}" ] && [ -r /etc/sustain/sustain.toml ]; then
    SUSTAIN_CONFIG=/etc/sustain/sustain.toml
    export SUSTAIN_CONFIG
fi

sustain=${SUSTAIN:-/opt/sustain/.venv/bin/sustain}
limit=${SUSTAIN_HEALTH_TIMEOUT:-30}
node=${SLURMD_NODENAME:-$(hostname -s)}
prefix="sustain:"

say() {
    logger -t sustain-healthcheck -p "daemon.${1}" -- "${2}"
}

# The reason the node is drained for, without the "[user@time]" scontrol appends; empty when the
# node is not drained. `scontrol show node NODE` prints, among other lines:
#    State=IDLE+DRAIN ThreadsPerCore=2 TmpDisk=0 Weight=1 Owner=N/A MCS_label=N/A
#    Reason=sustain: unhealthy: GPU 1 xid_79 [root@2026-01-05T10:00:00]
drain_reason() {
    scontrol show node "${node}" | awk '
        /^ *State=/ { split($1, state, "="); drained = (state[2] ~ /DRAIN/) }
        /^ *Reason=/ { sub(/^ *Reason=/, ""); sub(/ \[[^]]*\]$/, ""); reason = $0 }
        END { if (drained) print reason }
    '
}

errors=$(mktemp) || exit 0
trap 'rm -f "${errors}"' EXIT
summary=$(timeout "${limit}" "${sustain}" health --summary 2>"${errors}")
status=$?

case ${status} in
    1)
        reason="${prefix} ${summary}"
        current=$(drain_reason)
        case ${current} in
            "${reason}") ;;
            "${prefix}"* | "")
                if scontrol update NodeName="${node}" State=DRAIN Reason="${reason}"; then
                    say notice "drained ${node}: ${reason}"
                else
                    say err "scontrol could not drain ${node} (${reason})"
                fi
                ;;
            *)
                say notice "${node} is drained by another tool (${current}); not drained for: ${reason}"
                ;;
        esac
        ;;
    0)
        current=$(drain_reason)
        case ${summary} in
            "healthy: "*"(archive"*) current="" ;;  # archived evidence: no resume
            "healthy: "* | "healthy") ;;
            *) current="" ;;
        esac
        case ${current} in
            "${prefix}"*)
                if scontrol update NodeName="${node}" State=RESUME; then
                    say notice "resumed ${node}: ${summary} (was drained: ${current})"
                else
                    say err "scontrol could not resume ${node}"
                fi
                ;;
            *) ;;
        esac
        ;;
    *)
        detail=$(head -c 400 "${errors}" || true)
        say warning "no verdict for ${node}: ${sustain} health exited ${status}: ${summary} ${detail}"
        ;;
esac
exit 0
