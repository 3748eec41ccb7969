#!/usr/bin/env bash
# Build a CPU-only Ollama for the test suite and cache it outside the repo.
#
# Source: the Go module `github.com/ollama/ollama` from the Go module proxy, built with
# `go build .` (cgo compiles Ollama's vendored llama.cpp/ggml with its CPU backend).
# Go module zips leave out every `vendor/` folder, so llama.cpp's three header-only
# libraries are put back before the build:
#   llama/llama.cpp/vendor/nlohmann/   json.hpp, json_fwd.hpp  (Debian nlohmann-json3-dev)
#   llama/llama.cpp/vendor/stb/        stb_image.h             (Debian libstb-dev)
#   llama/llama.cpp/vendor/miniaudio/  miniaudio.h             (the `miniaudio` sdist on PyPI)
#
# Cache layout (VACANCYD_TOOLS_CACHE defaults to ~/.cache/vacancyd-tools):
#   $VACANCYD_TOOLS_CACHE/ollama/
#     current -> <version>      symlink to the newest complete build
#     <version>/
#       ollama                  the binary (`ollama serve`, `ollama create`, ...)
#       BUILD-INFO              versions, build time
#       .complete               written last; its presence means "usable"
#
# Environment:
#   VACANCYD_TOOLS_CACHE   cache root (see above)
#   OLLAMA_VERSION         module version to build, without the leading "v" (pinned default
#                          below, so the cache check needs no network)
#   MINIAUDIO_VERSION      PyPI sdist that supplies miniaudio.h (pinned default below)
#   BUILD_JOBS             parallel compile jobs for cgo (default 2)
#   PYTHON                 interpreter whose pip downloads the miniaudio sdist (default: repo
#                          .venv, then python3)
#   GO                     go command (default: `go` on PATH, then /usr/local/go/bin/go)
#   FORCE=1                rebuild even if the cache already has this version
set -euo pipefail

VERSION="${OLLAMA_VERSION:-0.17.4}"
MINIAUDIO_VERSION="${MINIAUDIO_VERSION:-1.71}"
JOBS="${BUILD_JOBS:-2}"
CACHE_ROOT="${VACANCYD_TOOLS_CACHE:-$HOME/.cache/vacancyd-tools}/ollama"
DEST="$CACHE_ROOT/$VERSION"
MODULE="github.com/ollama/ollama"

log() { printf '[build-ollama] %s\n' "$*" >&2; }

point_current() {
    ln -sfn "$VERSION" "$CACHE_ROOT/current.tmp.$$"
    mv -Tf "$CACHE_ROOT/current.tmp.$$" "$CACHE_ROOT/current"
}

if [[ "${FORCE:-0}" != 1 && -f "$DEST/.complete" && -x "$DEST/ollama" ]]; then
    point_current
    log "cached: $DEST/ollama (ollama $VERSION); nothing to do"
    echo "$DEST/ollama"
    exit 0
fi

if [[ -z "${GO:-}" ]]; then
    if command -v go >/dev/null; then
        GO=go
    elif [[ -x /usr/local/go/bin/go ]]; then
        GO=/usr/local/go/bin/go
    else
        log "missing required tool: go (Ollama $VERSION needs a recent Go toolchain)"
        exit 1
    fi
fi
# Go >= 1.21 fetches the toolchain the module's go.mod asks for (GOTOOLCHAIN=auto, through
# the module proxy); older ones cannot build Ollama at all.
GO_MINOR="$("$GO" env GOVERSION 2>/dev/null | sed -n 's/^go1\.\([0-9]*\).*/\1/p')"
if [[ -z "$GO_MINOR" || "$GO_MINOR" -lt 21 ]]; then
    log "$("$GO" version 2>&1) is too old: Ollama $VERSION needs Go >= 1.21 (https://go.dev/dl/)"
    exit 1
fi
export GOTOOLCHAIN="${GOTOOLCHAIN:-auto}"
for tool in c++ cc tar; do
    command -v "$tool" >/dev/null || { log "missing required tool: $tool"; exit 1; }
done
NLOHMANN=/usr/include/nlohmann
STB=/usr/include/stb
[[ -f "$NLOHMANN/json.hpp" && -f "$NLOHMANN/json_fwd.hpp" ]] \
    || { log "missing $NLOHMANN/json.hpp (Debian package nlohmann-json3-dev)"; exit 1; }
[[ -f "$STB/stb_image.h" ]] \
    || { log "missing $STB/stb_image.h (Debian package libstb-dev)"; exit 1; }

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [[ -z "${PYTHON:-}" ]]; then
    if [[ -x "$REPO_ROOT/.venv/bin/python" ]]; then
        PYTHON="$REPO_ROOT/.venv/bin/python"
    else
        PYTHON="python3"
    fi
fi

mkdir -p "$CACHE_ROOT"
# One build at a time per cache, in a work tree whose path never changes: cgo's objects are
# cached by Go (GOCACHE) under keys that include the source path, so a build that failed or
# was interrupted resumes from what it had compiled instead of starting over.
exec 9>"$CACHE_ROOT/.build.lock"
if ! flock -n 9; then
    log "another build holds $CACHE_ROOT/.build.lock; waiting for it"
    flock 9
    if [[ "${FORCE:-0}" != 1 && -f "$DEST/.complete" && -x "$DEST/ollama" ]]; then
        log "built meanwhile: $DEST/ollama"
        echo "$DEST/ollama"
        exit 0
    fi
fi
WORK="$CACHE_ROOT/.build-$VERSION"
cleanup() { chmod -R u+w "$WORK" 2>/dev/null || true; rm -rf "$WORK"; }
cleanup
mkdir -p "$WORK"
trap cleanup EXIT

START=$(date +%s)

log "downloading $MODULE@v$VERSION from the Go module proxy"
MODDIR="$("$GO" mod download -json "$MODULE@v$VERSION" \
    | "$PYTHON" -c 'import json, sys; print(json.load(sys.stdin)["Dir"])')"
[[ -f "$MODDIR/go.mod" ]] || { log "go mod download gave no module directory"; exit 1; }

log "copying the module to a writable tree"
SRC="$WORK/src"
cp -r "$MODDIR" "$SRC"
chmod -R u+w "$SRC"

log "downloading miniaudio==$MINIAUDIO_VERSION sdist from PyPI (pip: $PYTHON)"
"$PYTHON" -m pip download --quiet --no-deps --no-binary miniaudio \
    -d "$WORK/dl" "miniaudio==$MINIAUDIO_VERSION"
mkdir -p "$WORK/miniaudio"
tar -xzf "$WORK"/dl/miniaudio-*.tar.gz -C "$WORK/miniaudio"
MINIAUDIO_H="$(find "$WORK/miniaudio" -path '*/miniaudio/miniaudio.h' | head -n1)"
[[ -f "$MINIAUDIO_H" ]] || { log "no miniaudio/miniaudio.h in the miniaudio sdist"; exit 1; }

VENDOR="$SRC/llama/llama.cpp/vendor"
mkdir -p "$VENDOR/nlohmann" "$VENDOR/stb" "$VENDOR/miniaudio"
cp "$NLOHMANN/json.hpp" "$NLOHMANN/json_fwd.hpp" "$VENDOR/nlohmann/"
cp "$STB/stb_image.h" "$VENDOR/stb/"
cp "$MINIAUDIO_H" "$VENDOR/miniaudio/"

log "building ollama $VERSION (go build, cgo -j$JOBS; this takes a while on few cores)"
(
    cd "$SRC"
    CGO_ENABLED=1 GOFLAGS=-buildvcs=false GOMAXPROCS="$JOBS" \
        "$GO" build -p "$JOBS" -trimpath \
        -ldflags "-s -w -X $MODULE/version.Version=$VERSION" -o "$WORK/ollama" .
) >"$WORK/build.log" 2>&1 || { tail -n 80 "$WORK/build.log" >&2; log "go build failed"; exit 1; }
[[ -x "$WORK/ollama" ]] || { log "build failed: no binary"; exit 1; }

log "smoke test: ollama --version"
"$WORK/ollama" --version >&2 || true

log "installing into $DEST"
rm -rf "$DEST.tmp.$$"
mkdir -p "$DEST.tmp.$$"
cp "$WORK/ollama" "$DEST.tmp.$$/ollama"
cp "$SRC/LICENSE" "$DEST.tmp.$$/LICENSE.ollama"
END=$(date +%s)
{
    echo "ollama module: $MODULE@v$VERSION"
    echo "miniaudio sdist: $MINIAUDIO_VERSION"
    echo "built: $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(uname -m), $("$GO" version), $(c++ --version | head -n1)"
    echo "build seconds: $((END - START))"
} >"$DEST.tmp.$$/BUILD-INFO"
touch "$DEST.tmp.$$/.complete"
rm -rf "$DEST"
mv "$DEST.tmp.$$" "$DEST"
point_current

log "done in $((END - START)) s: $DEST/ollama"
echo "$DEST/ollama"
