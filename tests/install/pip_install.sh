#!/usr/bin/env bash
# CI test (run by scripts/test): the Python package as a user gets it. Copies the checkout
# (tracked and untracked, not ignored files) into a scratch directory, creates a fresh
# virtual environment there, installs torch from the local wheel cache, runs
# `pip install --no-build-isolation .` and `pip wheel`, then, from outside the source
# tree, imports dwgraph and runs a short graphed training loop (smoke_train.py).
#
# The copy keeps this checkout's layout (sources, .venv/, build/), so with ccache the pip
# build compiles nothing the development build has compiled (CMakeLists.txt: paths under
# the source root are hashed relative to the build directory); the hits are printed.
set -euo pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD
WHEELHOUSE=${DWGRAPH_WHEELHOUSE:-${XDG_CACHE_HOME:-$HOME/.cache}/dwgraph/wheels}
WORK=$(mktemp -d "${TMPDIR:-/tmp}/dwgraph-pip.XXXXXX")
cleanup() { local c; c=$(date +%s); rm -rf "$WORK"; echo "pip_install: removed $WORK ($(($(date +%s) - c)) s)"; }
[ -n "${DWGRAPH_KEEP_WORK:-}" ] || trap cleanup EXIT   # kept for a post-mortem
SRC=$WORK/dwgraph
fail() { echo "pip_install: $*" >&2; exit 1; }
t0=$(date +%s)
lap() { local now; now=$(date +%s); echo "pip_install: $1 ($((now - t0)) s)"; t0=$now; }

mkdir -p "$SRC"
git ls-files -z --cached --others --exclude-standard \
  | while IFS= read -r -d '' f; do [ -e "$f" ] && printf '%s\0' "$f"; done \
  | tar --null -T - -cf - | tar -xf - -C "$SRC"
# The development venv's interpreter and packages at the same versions, so the build sees
# the same torch; without triton (1 GB that `import torch` does not load) and without
# byte-compiling (torch's Python files would take longer than the build): the venv's 4 GB
# are most of this test's time, writing them and removing them.
base_python=$("$ROOT/.venv/bin/python" -c 'import sys; print(sys._base_executable)')
"$ROOT/.venv/bin/python" -m pip freeze --exclude-editable | grep -v '^triton==' >"$WORK/requirements.txt"
"$base_python" -m venv "$SRC/.venv"
PIP=("$SRC/.venv/bin/python" -m pip)
"${PIP[@]}" install -q --no-compile --no-deps --no-index --find-links "$WHEELHOUSE" -r "$WORK/requirements.txt"
lap "fresh venv with torch from $WHEELHOUSE"

# --no-deps: the venv has torch; pip would otherwise look for torch's triton.
cd "$SRC"
export CCACHE_STATSLOG=$WORK/ccache.log
export CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}
"${PIP[@]}" install --no-build-isolation --no-deps --no-index -C build-dir=build . >"$WORK/install.log" 2>&1 \
  || { tail -n 60 "$WORK/install.log"; fail "pip install --no-build-isolation . failed"; }
if [ -f "$CCACHE_STATSLOG" ]; then
  hits=$(grep -cE '^(direct|preprocessed)_cache_hit$' "$CCACHE_STATSLOG" || true)  # grep -c exits 1 on 0
  misses=$(grep -c '^cache_miss$' "$CCACHE_STATSLOG" || true)
  cache="ccache: $hits hits, $misses misses"
else
  cache="no ccache"
fi
lap "pip install --no-build-isolation . ($cache)"
"${PIP[@]}" wheel --no-build-isolation --no-index --no-deps -C build-dir=build -w "$WORK/dist" . >"$WORK/wheel.log" 2>&1 \
  || { tail -n 60 "$WORK/wheel.log"; fail "pip wheel --no-build-isolation . failed"; }
unset CCACHE_STATSLOG
lap "pip wheel (same build directory)"

# The wheel: the package and its metadata only; binaries with run paths relative to themselves.
"$SRC/.venv/bin/python" - "$WORK/dist"/dwgraph-*.whl <<'PY'
import sys, zipfile
names = zipfile.ZipFile(sys.argv[1]).namelist()
stray = [n for n in names if not (n.startswith("dwgraph/") or ".dist-info/" in n)]
assert not stray, f"files outside the package in the wheel: {stray}"
for need in ("dwgraph/__init__.py", "dwgraph/libdwgraph.so"):
    assert need in names, f"{need} missing from the wheel: {names}"
assert any(n.startswith("dwgraph/_C.") and n.endswith(".so") for n in names), names
PY
site=$("$SRC/.venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["platlib"])')
for so in "$site"/dwgraph/*.so; do
  runpath=$(readelf -d "$so" | sed -n 's/.*R\(UN\)\?PATH.*\[\(.*\)\]/\2/p')
  [ -n "$runpath" ] || fail "$(basename "$so") has no run path"
  IFS=: read -r -a entries <<<"$runpath"
  for e in "${entries[@]}"; do
    case "$e" in '$ORIGIN'*) ;; *) fail "$(basename "$so") run path entry '$e' is not relative to \$ORIGIN ($runpath)" ;; esac
  done
done

mkdir -p "$WORK/elsewhere"
cd "$WORK/elsewhere"
"$SRC/.venv/bin/python" "$ROOT/tests/install/smoke_train.py"
lap "import from outside the source tree, graphed training loop"
