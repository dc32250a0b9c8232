#!/bin/sh
# A command timed against two builds of the library in turn, in one session (a GPU's clocks and
# neighbours drift between sessions, so only alternated runs compare):
#
#   bench/ab.sh BASE ROUNDS command [args...]
#   bench/ab.sh cfc00e6 3 python3 tests/gpu/bench_decode_splits.py --splits 0 --batch 32
#
# "new" is the working tree's build-cuda/libflashattn.so (make gpu-build; NEW_LIB overrides) with
# the working tree's package; "old" is commit BASE's library and BASE's own package (its C fast
# path too), built once into build-ab/BASE, so each side's Python calls the C API it was written
# for. Each round runs old then new. Kernels compile into the usual cache: their keys carry the
# source's hash, so the two builds never share one.
set -e
if [ $# -lt 3 ]; then
    echo "usage: bench/ab.sh BASE ROUNDS command [args...]" >&2
    exit 2
fi
base=$1
rounds=$2
shift 2
dir=build-ab/$base
old=$PWD/$dir/b/libflashattn.so
new=${NEW_LIB:-$PWD/build-cuda/libflashattn.so}
if [ ! -f "$new" ]; then
    echo "bench/ab.sh: no $new (make gpu-build, or set NEW_LIB)" >&2
    exit 2
fi
if [ ! -f "$old" ]; then
    rm -rf "$dir"
    mkdir -p "$dir/src"
    git archive "$base" | tar -x -C "$dir/src"
    cmake -S "$dir/src" -B "$dir/b" -DCMAKE_BUILD_TYPE=Release > "$dir/build.log" 2>&1
    cmake --build "$dir/b" --target flashattn flashattn_fastpath -j "${JOBS:-16}" >> "$dir/build.log" 2>&1 || {
        echo "bench/ab.sh: building $base failed, see $dir/build.log" >&2
        exit 1
    }
    if [ -f "$dir/b/_fastpath.abi3.so" ]; then
        ln -sf "$PWD/$dir/b/_fastpath.abi3.so" "$dir/src/python/flashattn/_fastpath.abi3.so"
    fi
fi
head=$(git rev-parse --short HEAD)
i=1
while [ "$i" -le "$rounds" ]; do
    echo "== old ($base), round $i"
    FLASHATTN_LIBRARY=$old PYTHONPATH=$dir/src/python "$@"
    echo "== new ($head, working tree), round $i"
    FLASHATTN_LIBRARY=$new PYTHONPATH=python "$@"
    i=$((i + 1))
done
