#!/usr/bin/env bash
# Build (once) the Kubernetes test tools that vacancyd's kube tests run against.
#
# Output: ${VACANCYD_TOOLS_CACHE:-$HOME/.cache/vacancyd-tools}/kube/bin/
#   kube-apiserver  k8s.io/kubernetes/cmd/kube-apiserver, built through the
#                   wrapper module tools/kube-wrapper (its go.mod pins the
#                   k8s.io/kubernetes version and the k8s.io staging modules)
#   etcd            Debian's etcd-server package (extracted with dpkg -x, never
#                   installed, so no system etcd service is started), or built
#                   from go.etcd.io/etcd/server/v3 when apt does not have it
#   helm            helm.sh/helm/v3/cmd/helm
#   kubeconform     github.com/yannh/kubeconform/cmd/kubeconform
#   promtool        Debian's prometheus package (extracted, not installed), or
#                   built from github.com/prometheus/prometheus/cmd/promtool
# Each binary has a stamp file, bin/.<name>.version; a tool whose binary and
# stamp are present and current is skipped, so a second run takes seconds.
# The Go module and build caches live under the same cache directory
# (go/mod, go/cache) so they persist between runs and machines that keep it.
#
# Environment:
#   VACANCYD_TOOLS_CACHE  cache root (default ~/.cache/vacancyd-tools)
#   VACANCYD_ETCD_SOURCE, VACANCYD_PROMTOOL_SOURCE
#                         auto (default: Debian package, else Go), deb or go
#   GO                    go command (default: go on PATH, else /usr/local/go/bin/go)
#   BUILD_JOBS            go build -p (default 2)
#
# Cost, measured cold on a 2-core machine shared with other builds: kube-apiserver
# ~14 min (the link needs a few GiB of memory), helm ~3-4 min, kubeconform
# ~10 s, etcd and promtool from Debian a few seconds each (from Go instead:
# etcd ~2 min, promtool ~11 min). A warm run (everything present) takes <1 s.
# The Go caches under the cache root grow to ~6 GiB.
#
# kubeconform offline: it validates against JSON schemas that it normally
# downloads from a GitHub-hosted schema repository, so with no network its
# default run fails. It does not need the network otherwise: a
# -schema-location that is a local path template, for example
#   -schema-location '/some/dir/{{ .ResourceKind }}{{ .KindSuffix }}.json'
# (ResourceKind = lower-cased kind, KindSuffix = "-<first label of the group>-<version>",
# e.g. node-v1.json, endpointslice-discovery-v1.json), is read with its file
# loader only, and relative "$ref"s inside those files resolve against the
# file's own directory. tests/support/kube.py (write_kubeconform_schemas)
# generates such a directory at test time from the running test
# kube-apiserver's /openapi/v2, so the schemas always match the API server
# version (quantities and int-or-string are widened to string|number, scalar
# fields may be null as in generated manifests, and a "-strict" tree sets
# additionalProperties: false); tests/integration/test_kube_support.py checks that it
# accepts valid objects and rejects invalid ones. Caveat: a schema that fails
# to load makes kubeconform report the resource as skipped (not failed), so
# callers should pass -summary/-output json and check that nothing was skipped.
set -Eeuo pipefail

log() { printf '[build-kube-tools] %s\n' "$*" >&2; }
die() { log "error: $*"; exit 1; }
trap 'log "error: command failed (exit $?) at line $LINENO: $BASH_COMMAND"' ERR
# first_line CMD...: run CMD and print the first line of its output (no `| head`,
# which can kill CMD with SIGPIPE and so fail the script under pipefail).
first_line() {
    local out
    out="$("$@" 2>&1)"
    printf '%s\n' "${out%%$'\n'*}" >&2
}

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
WRAPPER="$HERE/kube-wrapper"

CACHE="${VACANCYD_TOOLS_CACHE:-$HOME/.cache/vacancyd-tools}"
BIN="$CACHE/kube/bin"
SRC="$CACHE/kube/src"
mkdir -p "$BIN" "$SRC" "$CACHE/go/mod" "$CACHE/go/cache"

# Versions. kube-apiserver's comes from the wrapper's go.mod (single source of
# truth); keep it on the kubectl minor (1.32). helm 3.17 is built on the 1.32
# client libraries. The etcd fallback matches the etcd client of k8s 1.32.
KUBE_VERSION="$(awk '$1 == "require" { $1 = ""; $0 = $0 } $1 == "k8s.io/kubernetes" { print $2; exit }' \
    "$WRAPPER/go.mod")"
[[ -n "$KUBE_VERSION" ]] || die "cannot read the k8s.io/kubernetes version from $WRAPPER/go.mod"
HELM_VERSION="v3.17.4"
KUBECONFORM_VERSION="v0.7.0"
ETCD_GO_VERSION="v3.5.16"
PROMETHEUS_GO_VERSION="v0.42.0" # Go module version of Prometheus 2.42, as in Debian 12

if [[ -z "${GO:-}" ]]; then
    GO="$(command -v go || true)"
    [[ -n "$GO" ]] || GO=/usr/local/go/bin/go
fi
[[ -x "$GO" ]] || die "no go command (set GO=/path/to/go)"

export GOMODCACHE="$CACHE/go/mod"
export GOCACHE="$CACHE/go/cache"
export GOFLAGS="-mod=mod"
export GOTOOLCHAIN=local
export CGO_ENABLED=0
JOBS="${BUILD_JOBS:-2}"
GO_BUILD_FLAGS=(-p "$JOBS" -trimpath "-ldflags=-s -w")

log "cache: $CACHE ($("$GO" version))"

# is_current NAME VERSION: the binary and its stamp are there and match.
is_current() {
    [[ -x "$BIN/$1" && -f "$BIN/.$1.version" && "$(cat "$BIN/.$1.version")" == "$2" ]]
}
stamp() { printf '%s\n' "$2" >"$BIN/.$1.version"; }

# timed NAME VERSION FUNCTION: run FUNCTION unless NAME is current; report time.
timed() {
    local name="$1" version="$2" fn="$3" start
    if is_current "$name" "$version"; then
        log "$name: present ($version), skipped"
        return 0
    fi
    start=$SECONDS
    log "$name: building $version ..."
    "$fn" "$version"
    stamp "$name" "$version"
    log "$name: done in $((SECONDS - start)) s -> $BIN/$name"
}

APT_UPDATED=0
# deb_has PACKAGE: apt knows PACKAGE (runs apt-get update once if needed and root).
deb_has() {
    command -v apt-get >/dev/null || return 1
    if apt-cache show "$1" >/dev/null 2>&1; then return 0; fi
    if [[ $APT_UPDATED == 0 && $(id -u) == 0 ]]; then
        log "apt-get update"
        apt-get update -qq >&2 || true
        APT_UPDATED=1
        apt-cache show "$1" >/dev/null 2>&1 && return 0
    fi
    return 1
}

# deb_extract PACKAGE PATH_IN_PACKAGE DEST: download PACKAGE's .deb (no
# install, no maintainer scripts) and copy one file out of it. Each step checks
# its own status, since callers run it as an `if` condition (where set -e is off).
deb_extract() {
    local pkg="$1" path="$2" dest="$3" tmp rc=0
    local apt_opts=()
    # As root, apt would hand the download to user _apt, who cannot write here.
    [[ $(id -u) == 0 ]] && apt_opts=(-o APT::Sandbox::User=root)
    tmp="$(mktemp -d)" || return 1
    { (cd "$tmp" && apt-get download -q "${apt_opts[@]}" "$pkg" >&2) &&
        dpkg-deb -x "$tmp"/"$pkg"_*.deb "$tmp/root" &&
        install -m 0755 "$tmp/root/$path" "$dest.tmp" &&
        mv -f "$dest.tmp" "$dest"; } || rc=$?
    rm -rf "$tmp"
    return "$rc"
}

# deb_or_go NAME SOURCE DEB_PACKAGE PATH_IN_PACKAGE MODULE@VERSION GO_PACKAGE:
# put NAME into $BIN from the Debian package (an installed copy, or else the
# downloaded .deb), or build it with Go. SOURCE is auto, deb or go; auto falls
# back to Go when apt lacks the package or the download fails.
deb_or_go() {
    local name="$1" source="$2" pkg="$3" path="$4" modver="$5" gopkg="$6"
    if [[ $source != go ]] && deb_has "$pkg"; then
        if [[ -x "/$path" ]] && dpkg -s "$pkg" >/dev/null 2>&1; then
            install -m 0755 "/$path" "$BIN/$name"
            return 0
        fi
        if deb_extract "$pkg" "$path" "$BIN/$name"; then
            return 0
        fi
        [[ $source == deb ]] && die "$name: downloading Debian package $pkg failed"
        log "$name: downloading Debian package $pkg failed; building with Go instead"
    elif [[ $source == deb ]]; then
        die "$name: source 'deb' asked for, but apt has no package $pkg"
    fi
    go_build_via_module "$modver" "$gopkg" "$BIN/$name"
}

# go_build_via_module MODULE@VERSION PACKAGE DEST: build PACKAGE inside a
# throwaway main module under the cache. Unlike `go install pkg@version`, this
# works when the target module's go.mod has replace directives (etcd's do).
go_build_via_module() {
    local modver="$1" pkg="$2" dest="$3" dir
    dir="$SRC/$(basename "$dest")-wrapper"
    rm -rf "$dir"
    mkdir -p "$dir"
    (
        cd "$dir"
        "$GO" mod init "vacancyd.local/tools/$(basename "$dest")-wrapper" >/dev/null 2>&1
        "$GO" get "$modver"
        "$GO" build "${GO_BUILD_FLAGS[@]}" -o "$dest.tmp" "$pkg"
    )
    mv -f "$dest.tmp" "$dest"
}

build_kube_apiserver() {
    (cd "$WRAPPER" && "$GO" build "${GO_BUILD_FLAGS[@]}" -o "$BIN/kube-apiserver.tmp" \
        k8s.io/kubernetes/cmd/kube-apiserver)
    mv -f "$BIN/kube-apiserver.tmp" "$BIN/kube-apiserver"
    "$BIN/kube-apiserver" --version >&2
}

ETCD_SOURCE="${VACANCYD_ETCD_SOURCE:-auto}"
ETCD_WANT="etcd:$ETCD_SOURCE"
build_etcd() {
    deb_or_go etcd "$ETCD_SOURCE" etcd-server usr/bin/etcd \
        "go.etcd.io/etcd/server/v3@$ETCD_GO_VERSION" go.etcd.io/etcd/server/v3
    first_line "$BIN/etcd" --version
}

# Helm stamps its version, and the Kubernetes version that `helm template` /
# `helm lint` assume (.Capabilities.KubeVersion), in at link time; without these
# -X flags a plain build reports "v3.17" and Kubernetes v1.20.0.
HELM_KUBE_MINOR=32
build_helm() {
    local x=helm.sh/helm/v3
    GOBIN="$BIN" "$GO" install -p "$JOBS" -trimpath -ldflags="-s -w \
        -X $x/internal/version.version=$HELM_VERSION \
        -X $x/internal/version.gitTreeState=clean \
        -X $x/pkg/chartutil.k8sVersionMajor=1 -X $x/pkg/chartutil.k8sVersionMinor=$HELM_KUBE_MINOR \
        -X $x/pkg/lint/rules.k8sVersionMajor=1 -X $x/pkg/lint/rules.k8sVersionMinor=$HELM_KUBE_MINOR" \
        "$x/cmd/helm@$HELM_VERSION"
    "$BIN/helm" version --short >&2
}

build_kubeconform() {
    GOBIN="$BIN" "$GO" install -p "$JOBS" -trimpath \
        -ldflags="-s -w -X main.version=$KUBECONFORM_VERSION" \
        "github.com/yannh/kubeconform/cmd/kubeconform@$KUBECONFORM_VERSION"
    "$BIN/kubeconform" -v >&2
}

PROMTOOL_SOURCE="${VACANCYD_PROMTOOL_SOURCE:-auto}"
PROMTOOL_WANT="promtool:$PROMTOOL_SOURCE"
build_promtool() {
    deb_or_go promtool "$PROMTOOL_SOURCE" prometheus usr/bin/promtool \
        "github.com/prometheus/prometheus@$PROMETHEUS_GO_VERSION" \
        github.com/prometheus/prometheus/cmd/promtool
    first_line "$BIN/promtool" --version
}

total=$SECONDS
# Cheap ones first, so a failure in the long kube-apiserver build still leaves them.
timed etcd "$ETCD_WANT" build_etcd
timed promtool "$PROMTOOL_WANT" build_promtool
timed kubeconform "$KUBECONFORM_VERSION" build_kubeconform
timed helm "$HELM_VERSION" build_helm
timed kube-apiserver "$KUBE_VERSION" build_kube_apiserver
log "all tools ready in $BIN ($((SECONDS - total)) s)"
