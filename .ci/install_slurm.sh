#!/usr/bin/env bash
# Install what tests/slurm_cluster.py needs to run a real two-node SLURM test
# cluster on this one machine: slurmctld, slurmd, the client commands, munge,
# slurmdbd + MariaDB (accounting mode), iproute2 and util-linux (unshare/nsenter).
#
# Idempotent: when every binary is already there it does nothing (no apt at all).
# It never leaves a daemon running: package maintainer scripts are told not to
# start services (policy-rc.d), and the test harness starts its own daemons with
# its own config under a temporary directory.
#
# Usage: bash .ci/install_slurm.sh        (as root, Debian 12)
set -euo pipefail

PACKAGES=(
    slurmctld slurmd slurm-client slurmdbd munge
    mariadb-server mariadb-client
    iproute2 util-linux procps
)
# Binary -> package that provides it; all must be found for the fast path.
declare -A NEEDED=(
    [slurmctld]=slurmctld
    [slurmd]=slurmd
    [slurmdbd]=slurmdbd
    [sbatch]=slurm-client
    [sacct]=slurm-client
    [munged]=munge
    [mariadbd]=mariadb-server
    [mariadb-install-db]=mariadb-server
    [ip]=iproute2
    [nsenter]=util-linux
    [unshare]=util-linux
)

log() { printf '[install_slurm] %s\n' "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }

missing_binaries() {
    local bin
    for bin in "${!NEEDED[@]}"; do
        # sbin paths are not always on PATH for non-login shells.
        if ! PATH="$PATH:/usr/sbin:/sbin" command -v "$bin" >/dev/null 2>&1; then
            printf '%s ' "$bin"
        fi
    done
}

POLICY=/usr/sbin/policy-rc.d
POLICY_CREATED=0

block_service_starts() {
    # invoke-rc.d consults policy-rc.d; exit 101 means "action forbidden".
    # Without it, postinst scripts try to start munge/mariadb/slurm daemons.
    if [[ ! -e $POLICY ]]; then
        printf '#!/bin/sh\nexit 101\n' >"$POLICY"
        chmod 755 "$POLICY"
        POLICY_CREATED=1
    fi
}

restore_service_starts() {
    if [[ $POLICY_CREATED == 1 ]]; then
        rm -f "$POLICY"
    fi
}

main() {
    [[ $(id -u) == 0 ]] || die "must run as root (installs Debian packages)"

    local missing
    missing=$(missing_binaries)
    if [[ -z $missing ]]; then
        log "all SLURM test-cluster tools already installed; nothing to do"
        return 0
    fi
    log "missing: $missing-> installing ${PACKAGES[*]}"
    command -v apt-get >/dev/null || die "apt-get not found: this script supports Debian/Ubuntu only"

    trap restore_service_starts EXIT
    block_service_starts
    export DEBIAN_FRONTEND=noninteractive

    if ! apt-get update -qq; then
        die "apt-get update failed (is the Debian package mirror reachable?)"
    fi
    if ! apt-get install -y -qq --no-install-recommends "${PACKAGES[@]}" >/tmp/install_slurm.apt.log 2>&1; then
        tail -n 40 /tmp/install_slurm.apt.log >&2 || true
        die "apt-get install failed; full log in /tmp/install_slurm.apt.log"
    fi

    missing=$(missing_binaries)
    [[ -z $missing ]] || die "installed packages but still missing binaries: $missing"
    log "done: $(slurmctld -V 2>/dev/null || echo 'slurm ?'), munge $(dpkg-query -W -f='${Version}' munge)"
}

main "$@"
