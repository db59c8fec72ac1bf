#!/usr/bin/env bash
# CI test (run by scripts/test): the C++ package as a user gets it. Installs the
# development build (scripts/setup's) into a temporary prefix with `cmake --install`, checks
# what was installed, then configures tests/install/consumer, a separate project that finds
# it with find_package(dwgraph) and compiles every C++ code block of README.md and docs/ as
# written, and runs those programs.
set -euo pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD
BUILD_DIR=${DWGRAPH_BUILD_DIR:-$ROOT/build}
export PATH="$ROOT/.venv/bin:$PATH"
WORK=$(mktemp -d "${TMPDIR:-/tmp}/dwgraph-consumer.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
PREFIX=$WORK/prefix
fail() { echo "consumer: $*" >&2; exit 1; }

cmake --install "$BUILD_DIR" --prefix "$PREFIX" >"$WORK/install.log"
for f in include/dwgraph/dwgraph.h include/dwgraph/graphs/manager.h lib/libdwgraph.so \
         lib/cmake/dwgraph/dwgraphConfig.cmake lib/cmake/dwgraph/dwgraphConfigVersion.cmake \
         lib/cmake/dwgraph/dwgraphTargets.cmake; do
  [ -f "$PREFIX/$f" ] || fail "expected $f in the install prefix; installed: $(cd "$PREFIX" && find . -type f | sort | tr '\n' ' ')"
done
[ ! -e "$PREFIX/dwgraph" ] || fail "the Python package (component python) was installed by a plain cmake --install"
# Installed headers include each other as "dwgraph/<dir>/..." only.
if bad=$(grep -rnE '#[[:space:]]*include[[:space:]]+"(common|allocator|ops|graphs|nn)/' "$PREFIX/include"); then
  fail "installed headers include source-tree paths:\n$bad"
fi
runpath=$(readelf -d "$PREFIX/lib/libdwgraph.so" | sed -n 's/.*R\(UN\)\?PATH.*\[\(.*\)\]/\2/p')
case ":$runpath:" in *":$BUILD_DIR"*) fail "libdwgraph.so's run path points into the build tree: $runpath" ;; esac

.venv/bin/python tests/python/docs_blocks.py --lang cpp --out "$WORK/blocks"
launcher=()
if command -v ccache >/dev/null; then
  # Paths under $WORK hashed relative to it: a second run hits the cache.
  launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER="cmake;-E;env;CCACHE_BASEDIR=$WORK;CCACHE_NOHASHDIR=1;ccache")
fi
cmake -S tests/install/consumer -B "$WORK/build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_PREFIX_PATH="$PREFIX" -DDOC_BLOCKS_DIR="$WORK/blocks" "${launcher[@]}" >"$WORK/configure.log" 2>&1 \
  || { cat "$WORK/configure.log"; fail "configuring the consumer project failed"; }
cmake --build "$WORK/build" -- -j"$(nproc)" >"$WORK/build.log" 2>&1 \
  || { tail -n 60 "$WORK/build.log"; fail "building the consumer project failed"; }
ctest --test-dir "$WORK/build" --output-on-failure
