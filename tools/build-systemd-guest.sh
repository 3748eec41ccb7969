#!/usr/bin/env bash
# Build the Debian 12 root file system the systemd tests boot with systemd-nspawn, and cache
# it outside the repository.
#
# The guest is a minimal Debian bookworm with a real systemd, dbus, Python and apt (for
# installing the .deb) and nothing else: procps is left out on purpose, so the unit is
# proven to work on a system without /bin/kill.
#
# Cache layout (VACANCYD_TOOLS_CACHE defaults to ~/.cache/vacancyd-tools):
#   $VACANCYD_TOOLS_CACHE/systemd-guest/
#     current -> <version>       symlink to the newest complete root file system
#     <version>/rootfs/          the guest's /
#     <version>/.complete        written last; its presence means "usable"
#
# Needs root, debootstrap and systemd-container (systemd-nspawn); installs both with apt-get
# when missing. The mirror is the first `URIs:` of /etc/apt/sources.list.d/debian.sources
# (or $DEBIAN_MIRROR). FORCE=1 rebuilds.
set -euo pipefail

VERSION="bookworm-1"
CACHE_ROOT="${VACANCYD_TOOLS_CACHE:-$HOME/.cache/vacancyd-tools}/systemd-guest"
DEST="$CACHE_ROOT/$VERSION"
PACKAGES="systemd,systemd-sysv,dbus,libnss-systemd,python3,python3-venv,ca-certificates"

log() { printf '[build-systemd-guest] %s\n' "$*" >&2; }

point_current() {
    ln -sfn "$VERSION" "$CACHE_ROOT/current.tmp.$$"
    mv -Tf "$CACHE_ROOT/current.tmp.$$" "$CACHE_ROOT/current"
}

if [[ "${FORCE:-0}" != 1 && -f "$DEST/.complete" ]]; then
    point_current
    log "cached: $DEST/rootfs; nothing to do"
    exit 0
fi

if [[ "$(id -u)" != 0 ]]; then
    log "needs root (debootstrap); the systemd tests skip (or fail in CI) without the guest"
    exit 1
fi
missing=()
command -v debootstrap >/dev/null || missing+=(debootstrap)
command -v systemd-nspawn >/dev/null || missing+=(systemd-container)
if [[ ${#missing[@]} -gt 0 ]]; then
    log "installing ${missing[*]}"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
fi

mirror="${DEBIAN_MIRROR:-}"
if [[ -z "$mirror" && -f /etc/apt/sources.list.d/debian.sources ]]; then
    mirror="$(awk '/^URIs:/ {print $2; exit}' /etc/apt/sources.list.d/debian.sources)"
fi
mirror="${mirror:-http://deb.debian.org/debian}"

mkdir -p "$CACHE_ROOT"
work="$(mktemp -d "$CACHE_ROOT/.build-$VERSION.XXXXXX")"
cleanup() {
    # debootstrap mounts /proc (and more) inside the tree; never delete through a mount.
    findmnt -rn -o TARGET | grep -F "$work/" | sort -r | xargs -r -n1 umount -l 2>/dev/null || true
    rm -rf --one-file-system "$work"
}
trap cleanup EXIT
started=$SECONDS
log "debootstrap bookworm from $mirror (about a minute, ~400 MB)"
debootstrap --variant=minbase --include="$PACKAGES" bookworm "$work/rootfs" "$mirror" \
    >"$work/debootstrap.log" 2>&1 || { tail -20 "$work/debootstrap.log" >&2; exit 1; }
# A guest without a network: no apt lists to fetch, no time to wait for a network.
rm -rf "$work/rootfs/var/lib/apt/lists/"* "$work/rootfs/var/cache/apt/archives/"*.deb
echo "vacancyd-guest" >"$work/rootfs/etc/hostname"
# Keep the boot short and quiet: nothing in the guest needs these.
for unit in systemd-networkd-wait-online.service apt-daily.timer apt-daily-upgrade.timer \
            e2scrub_all.timer fstrim.timer; do
    ln -sfn /dev/null "$work/rootfs/etc/systemd/system/$unit"
done
rm -rf "$DEST"
mkdir -p "$DEST"
mv "$work/rootfs" "$DEST/rootfs"
touch "$DEST/.complete"
point_current
log "built $DEST/rootfs in $((SECONDS - started)) s"
