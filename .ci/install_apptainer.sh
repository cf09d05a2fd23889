#!/usr/bin/env bash
# Install Apptainer on Debian 12 (bookworm), as root, idempotently.
#
# Apptainer is not packaged for bookworm. Debian unstable's apptainer .deb
# runs here once its two ELF executables (apptainer, starter) are pointed at
# unstable's own glibc: the script downloads the .debs through a private apt
# configuration (the system's sources and apt state are left untouched),
# unpacks them under $APPTAINER_PREFIX with dpkg-deb -x and patchelf's the
# interpreter and rpath. Apptainer detects that it was moved (relocatable
# install) and reads its configuration from $APPTAINER_PREFIX/etc/apptainer.
#
# It also:
#   * installs the host tools a build needs (debootstrap, squashfs-tools,
#     uidmap, squashfuse, fuse3, patchelf) with apt;
#   * sets "root default capabilities = file" in apptainer.conf (root here
#     lacks CAP_SYS_RESOURCE, and "full" makes every exec fail with
#     "Requesting capability set ... while permitted capability set is ...")
#     and grants root, in capability.json, every capability that the host
#     actually lets root have -- with "file" and an empty capability.json root
#     gets no capability at all in a container, and then the unsquashfs that
#     apptainer runs in a container (build --sandbox from a SIF, Bootstrap:
#     localimage, exec without squashfuse) fails to chown;
#   * adds "root:" lines to /etc/subuid and /etc/subgid (build --fakeroot);
#   * links apptainer and singularity (spython only calls "singularity")
#     into /usr/local/bin.
#
# A second run exits at once when everything is in place and works.
#
# Environment:
#   APPTAINER_PREFIX      install prefix          (default /opt/apptainer)
#   APPTAINER_LINK_DIR    where the links go       (default /usr/local/bin)
#   APPTAINER_DEB_SUITE   Debian suite to take the .debs from (default unstable)
#   APPTAINER_DEB_MIRROR  Debian mirror            (default http://deb.debian.org/debian)
#   APPTAINER_DEB_VERSION exact apptainer .deb version to take (default: newest)
#   APPTAINER_FORCE=1     reinstall even if a working install is found
#                         (the same as passing --force)
set -Eeuo pipefail

PREFIX="${APPTAINER_PREFIX:-/opt/apptainer}"
LINK_DIR="${APPTAINER_LINK_DIR:-/usr/local/bin}"
SUITE="${APPTAINER_DEB_SUITE:-unstable}"
MIRROR="${APPTAINER_DEB_MIRROR:-http://deb.debian.org/debian}"
PIN_VERSION="${APPTAINER_DEB_VERSION:-}"
FORCE="${APPTAINER_FORCE:-0}"
[[ "${1:-}" == "--force" ]] && FORCE=1

MULTIARCH=x86_64-linux-gnu
RUNTIME_DIR="$PREFIX/runtime-libs"      # unstable's glibc & co, for apptainer only
CONF="$PREFIX/etc/apptainer/apptainer.conf"
HOST_PACKAGES=(ca-certificates debootstrap squashfs-tools uidmap squashfuse fuse3 patchelf)
HOST_COMMANDS=(debootstrap mksquashfs unsquashfs newuidmap newgidmap squashfuse patchelf)
# Libraries the apptainer binaries link against, taken from the same suite so
# that they match its glibc (bookworm's would work today, but need not later).
RUNTIME_PACKAGES=(libc6 libseccomp2 libsqlite3-0)

STEP="start"
WORK=""
log() { printf 'install_apptainer.sh: %s\n' "$*"; }
die() { printf 'install_apptainer.sh: ERROR in step "%s": %s\n' "$STEP" "$*" >&2; exit 1; }
on_error() {
    local rc=$?
    printf 'install_apptainer.sh: FAILED in step "%s" (exit %s, line %s: %s)\n' \
        "$STEP" "$rc" "${BASH_LINENO[0]}" "$BASH_COMMAND" >&2
    exit "$rc"
}
cleanup() { [[ -n "$WORK" && -d "$WORK" ]] && rm -rf "$WORK"; return 0; }
trap on_error ERR
trap cleanup EXIT

step() { STEP="$1"; log "$1"; }

have_conf_tweak() { [[ -f "$CONF" ]] && grep -Eq '^[[:space:]]*root default capabilities[[:space:]]*=[[:space:]]*file[[:space:]]*$' "$CONF"; }
# Linux capability numbers (linux/capability.h), for reading /proc/self/status.
CAP_NAMES=(CHOWN DAC_OVERRIDE DAC_READ_SEARCH FOWNER FSETID KILL SETGID SETUID SETPCAP
    LINUX_IMMUTABLE NET_BIND_SERVICE NET_BROADCAST NET_ADMIN NET_RAW IPC_LOCK IPC_OWNER
    SYS_MODULE SYS_RAWIO SYS_CHROOT SYS_PTRACE SYS_PACCT SYS_ADMIN SYS_BOOT SYS_NICE
    SYS_RESOURCE SYS_TIME SYS_TTY_CONFIG MKNOD LEASE AUDIT_WRITE AUDIT_CONTROL SETFCAP
    MAC_OVERRIDE MAC_ADMIN SYSLOG WAKE_ALARM BLOCK_SUSPEND AUDIT_READ PERFMON BPF
    CHECKPOINT_RESTORE)
host_caps() {  # the capabilities root really has here, as CAP_* names
    local hex i
    hex="$(awk '/^CapPrm:/{print $2}' /proc/self/status)"
    for i in "${!CAP_NAMES[@]}"; do
        if (( (16#$hex >> i) & 1 )); then printf 'CAP_%s\n' "${CAP_NAMES[$i]}"; fi
    done
}
have_caps() {
    local f="$PREFIX/etc/apptainer/capability.json" c
    [[ -f "$f" ]] || return 1
    for c in $(host_caps); do grep -q "\"$c\"" "$f" || return 1; done
}
have_subid() { grep -q '^root:' /etc/subuid 2>/dev/null && grep -q '^root:' /etc/subgid 2>/dev/null; }
have_commands() { local c; for c in "${HOST_COMMANDS[@]}"; do command -v "$c" >/dev/null 2>&1 || return 1; done; }
links_ok() { [[ "$(readlink -f "$LINK_DIR/singularity" 2>/dev/null)" == "$(readlink -f "$PREFIX/bin/apptainer")" ]]; }
apptainer_works() {
    [[ -x "$LINK_DIR/apptainer" ]] \
        && [[ "$(readlink -f "$LINK_DIR/apptainer")" == "$(readlink -f "$PREFIX/bin/apptainer")" ]] \
        && "$LINK_DIR/apptainer" version >/dev/null 2>&1
}

# ---------------------------------------------------------------- fast path
if [[ "$FORCE" != 1 ]] && apptainer_works && links_ok && have_conf_tweak && have_caps && have_subid && have_commands; then
    log "apptainer $("$LINK_DIR/apptainer" version) already installed in $PREFIX; nothing to do"
    exit 0
fi

# ---------------------------------------------------------------- checks
step "check the host"
[[ "$(id -u)" == 0 ]] || die "must run as root"
[[ "$(uname -m)" == x86_64 ]] || die "only x86_64 is supported (found $(uname -m))"
{ command -v apt-get && command -v dpkg-deb; } >/dev/null || die "needs a Debian host (apt-get, dpkg-deb)"
if [[ -r /etc/os-release ]]; then
    # shellcheck disable=SC1091
    . /etc/os-release
    [[ "${VERSION_CODENAME:-}" == bookworm ]] || log "warning: written for Debian 12 (bookworm), found ${PRETTY_NAME:-unknown}"
fi
export DEBIAN_FRONTEND=noninteractive

# ---------------------------------------------------------------- host tools
step "install host packages with apt (${HOST_PACKAGES[*]})"
missing=()
for p in "${HOST_PACKAGES[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
done
if ((${#missing[@]})); then
    apt-get update -qq || die "apt-get update failed"
    apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null \
        || die "apt-get install ${missing[*]} failed"
fi
have_commands || die "still missing one of: ${HOST_COMMANDS[*]}"

# ---------------------------------------------------------------- apptainer itself
if [[ "$FORCE" == 1 ]] || ! apptainer_works; then
    WORK="$(mktemp -d /var/tmp/install-apptainer.XXXXXX)"
    APTDIR="$WORK/apt"
    mkdir -p "$APTDIR/lists/partial" "$APTDIR/cache/archives/partial" "$APTDIR/parts" "$APTDIR/prefs" "$WORK/debs"
    echo "deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] $MIRROR $SUITE main" > "$APTDIR/sources.list"
    touch "$APTDIR/status"
    # Private sources, lists, cache, preferences and dpkg status: the
    # system's apt never learns about the unstable suite.
    APT_OPTS=(
        -o "Dir::Etc::SourceList=$APTDIR/sources.list"
        -o "Dir::Etc::SourceParts=$APTDIR/parts"
        -o "Dir::Etc::Preferences=$APTDIR/prefs/none"
        -o "Dir::Etc::PreferencesParts=$APTDIR/prefs"
        -o "Dir::State::Lists=$APTDIR/lists"
        -o "Dir::State::status=$APTDIR/status"
        -o "Dir::Cache=$APTDIR/cache"
        -o "APT::Sandbox::User=root"
    )

    step "fetch the $SUITE package index (private apt state in $APTDIR)"
    apt-get "${APT_OPTS[@]}" update -qq || die "apt-get update for $SUITE from $MIRROR failed"

    step "download apptainer and its runtime libraries from $SUITE"
    ap_spec=apptainer
    [[ -n "$PIN_VERSION" ]] && ap_spec="apptainer=$PIN_VERSION"
    (cd "$WORK/debs" && apt-get "${APT_OPTS[@]}" download -qq "$ap_spec" "${RUNTIME_PACKAGES[@]}") \
        || die "apt-get download $ap_spec ${RUNTIME_PACKAGES[*]} from $SUITE failed"
    ap_deb="$(ls "$WORK"/debs/apptainer_*.deb)"
    ap_version="$(dpkg-deb -f "$ap_deb" Version)"

    step "unpack apptainer $ap_version into $PREFIX"
    mkdir -p "$WORK/ap" "$WORK/rt"
    dpkg-deb -x "$ap_deb" "$WORK/ap"
    for p in "${RUNTIME_PACKAGES[@]}"; do dpkg-deb -x "$(ls "$WORK"/debs/"${p}"_*.deb)" "$WORK/rt"; done
    STAGE="$PREFIX.new"
    rm -rf "$STAGE"
    mkdir -p "$STAGE/bin" "$STAGE/lib/$MULTIARCH" "$STAGE/etc" "$STAGE/var/lib" "$STAGE/share/doc" "$STAGE/runtime-libs"
    # Relocatable layout: <prefix>/bin/apptainer, <prefix>/etc/apptainer,
    # <prefix>/lib/<multiarch>/apptainer/{bin/starter,lib}, <prefix>/var/lib/apptainer.
    cp -a "$WORK/ap/usr/bin/apptainer" "$STAGE/bin/"
    cp -a "$WORK/ap/usr/bin/run-singularity.apptainer" "$STAGE/bin/run-singularity" 2>/dev/null || true
    cp -a "$WORK/ap/usr/lib/$MULTIARCH/apptainer" "$STAGE/lib/$MULTIARCH/"
    cp -a "$WORK/ap/etc/apptainer" "$STAGE/etc/"
    cp -a "$WORK/ap/var/lib/apptainer" "$STAGE/var/lib/"
    cp -a "$WORK/ap/usr/share/doc/apptainer" "$STAGE/share/doc/" 2>/dev/null || true
    cp -a "$WORK/ap/usr/share/bash-completion" "$STAGE/share/" 2>/dev/null || true
    # The starter derives its prefix as three levels above itself, which for
    # Debian's multiarch libexec dir is <prefix>/lib: point that at the real one.
    ln -s ../etc "$STAGE/lib/etc"
    ln -s ../var "$STAGE/lib/var"
    cp -a "$WORK/rt/usr/lib/$MULTIARCH/." "$STAGE/runtime-libs/"
    [[ -e "$STAGE/runtime-libs/ld-linux-x86-64.so.2" && -e "$STAGE/runtime-libs/libc.so.6" ]] \
        || die "glibc from $SUITE did not unpack as expected"
    echo "$ap_version" > "$STAGE/VERSION"

    step "patchelf apptainer and starter onto $SUITE's glibc"
    for exe in "$STAGE/bin/apptainer" "$STAGE/lib/$MULTIARCH/apptainer/bin/starter"; do
        # The final paths, not the staging ones: the stage is renamed below.
        patchelf --set-interpreter "$RUNTIME_DIR/ld-linux-x86-64.so.2" \
            --force-rpath --set-rpath "$RUNTIME_DIR" "$exe" || die "patchelf $exe failed"
    done

    step "configure $STAGE/etc/apptainer/apptainer.conf"
    sed -i -E 's/^[[:space:]]*root default capabilities[[:space:]]*=.*/root default capabilities = file/' \
        "$STAGE/etc/apptainer/apptainer.conf"
    grep -q '^root default capabilities = file$' "$STAGE/etc/apptainer/apptainer.conf" \
        || echo 'root default capabilities = file' >> "$STAGE/etc/apptainer/apptainer.conf"

    step "move the new install into place at $PREFIX"
    if [[ -e "$PREFIX" ]]; then
        rm -rf "$PREFIX.old"
        mv "$PREFIX" "$PREFIX.old"
    fi
    mv "$STAGE" "$PREFIX"
    rm -rf "$PREFIX.old"

    step "check that every library of apptainer and starter resolves"
    for exe in "$PREFIX/bin/apptainer" "$PREFIX/lib/$MULTIARCH/apptainer/bin/starter"; do
        out="$("$RUNTIME_DIR/ld-linux-x86-64.so.2" --list "$exe" 2>&1)" || die "cannot load $exe: $out"
        if grep -q 'not found' <<<"$out"; then die "unresolved libraries for $exe: $(grep 'not found' <<<"$out" | tr -s '\t ' ' ')"; fi
    done
fi

# ---------------------------------------------------------------- configuration that may be lost
step "ensure the apptainer.conf tweak (root default capabilities = file)"
if ! have_conf_tweak; then
    sed -i -E 's/^[[:space:]]*root default capabilities[[:space:]]*=.*/root default capabilities = file/' "$CONF"
    have_conf_tweak || echo 'root default capabilities = file' >> "$CONF"
fi

step "grant root the host's capabilities in capability.json"
if ! have_caps; then
    known="$("$PREFIX/bin/apptainer" capability avail | grep -o '^CAP_[A-Z_]*')" \
        || die "'apptainer capability avail' failed"
    grant="$(host_caps | grep -Fx -f <(printf '%s\n' "$known") | paste -sd, -)"
    [[ -n "$grant" ]] || die "could not work out which capabilities root has"
    "$PREFIX/bin/apptainer" capability add --user root "$grant" >/dev/null 2>&1 \
        || die "apptainer capability add --user root $grant failed"
    have_caps || die "capability.json does not list the host's capabilities after 'capability add'"
fi

step "ensure root: lines in /etc/subuid and /etc/subgid (for build --fakeroot)"
for f in /etc/subuid /etc/subgid; do
    touch "$f"
    if ! grep -q '^root:' "$f"; then
        # First free range at or above 100000, past every existing one.
        start="$(awk -F: 'BEGIN{m=100000} NF>=3 && $2+$3>m {m=$2+$3} END{print m}' "$f")"
        echo "root:$start:65536" >> "$f"
    fi
done

step "link apptainer and singularity into $LINK_DIR"
mkdir -p "$LINK_DIR"
ln -sfn "$PREFIX/bin/apptainer" "$LINK_DIR/apptainer"
ln -sfn "$PREFIX/bin/apptainer" "$LINK_DIR/singularity"

step "verify"
"$LINK_DIR/apptainer" version >/dev/null 2>&1 || die "'$LINK_DIR/apptainer version' does not run: $("$LINK_DIR/apptainer" version 2>&1 || true)"
conf_used="$("$LINK_DIR/apptainer" buildcfg | sed -n 's/^APPTAINER_CONF_FILE=//p')"
[[ "$conf_used" == "$CONF" ]] || die "apptainer reads $conf_used, expected $CONF"
"$LINK_DIR/singularity" version >/dev/null 2>&1 || die "'$LINK_DIR/singularity version' does not run"
log "apptainer $("$LINK_DIR/apptainer" version) installed in $PREFIX (config $CONF); $LINK_DIR/{apptainer,singularity}"
