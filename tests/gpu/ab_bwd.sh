#!/bin/sh
# ab_bwd.sh BASE_DIR CHANGE_DIR[,CHANGE_DIR...] [HDIMS [SEQLENS]]: the backward of source trees
# side by side, for kernel changes' A/B in one device call. Each tree is built (build-ab-base,
# build-ab-1, build-ab-2, ... in the order given) and timed through the same Python tree (this
# checkout's python/), so only the library differs: each change's backward tests (16 shards)
# and racecheck on two cases, then tests/gpu/bench_bwd.py for base and every change, twice over
# (alternated: the GPU's state drifts between runs by as much as a small change is worth), and
# `test_gpu_backward --bench` the same way. The device's copy of the checkout has no .git:
# export the other trees first, into a directory the copy carries, e.g.
#
#     git archive main | tar -x -C .wt/base                  # here
#     tests/gpu/ab_bwd.sh .wt/base .,.wt/other 64 2048,4096    # on the device
#
# A build directory left by another source tree is rebuilt from scratch. AB_TESTS names the test
# programs each change runs (default test_gpu_backward; add test_gpu_sm90 for a forward change,
# whose benchmark is bench_bwd's fwd column). AB_PHASES (default "tests bench") splits the work
# over two device calls when one would pass the call limit; the builds are kept between them.
# AB_CALLS=N times N calls back to back per bench_bwd run (default 1; 10 steadies the rows).
set -u
tests=${AB_TESTS:-test_gpu_backward}
phases=${AB_PHASES:-tests bench}
hdims=${3:-64,128}
seqlens=${4:-2048,4096,8192}
sides="base"
n=0
for src in $(echo "$2" | tr ',' ' '); do
    n=$((n + 1))
    sides="$sides $n"
done
tree() { # the source tree of side $1
    [ "$1" = base ] && echo "$base_src" && return
    echo "$changes" | tr ',' '\n' | sed -n "$1p"
}
base_src=$1
changes=$2
for side in $sides; do
    src=$(tree "$side")
    dir=build-ab-$side
    if [ -f "$dir/CMakeCache.txt" ] &&
        ! grep -q "^CMAKE_HOME_DIRECTORY:INTERNAL=$(cd "$src" && pwd)\$" "$dir/CMakeCache.txt"; then
        rm -rf "$dir"
    fi
    (cmake -S "$src" -B "$dir" -DCMAKE_BUILD_TYPE=Release >/dev/null &&
     cmake --build "$dir" -j 8 >"$dir.log" 2>&1 ||
     echo "$side ($src): build failed, see $dir.log") &
done
wait
for side in $sides; do
    test -f "build-ab-$side/libflashattn.so" || exit 1
done
case " $phases " in *" tests "*) ;; *) sides_tested= ;; esac
for side in ${sides_tested-$sides}; do
    [ "$side" = base ] && continue
    for t in $tests; do
        FA_SHARD_TIMEOUT=${FA_SHARD_TIMEOUT:-240} tests/gpu/run_sharded.sh 16 \
            "build-ab-$side/tests/gpu/$t" >"build-ab-$side/$t.log" 2>&1
        echo "change $side ($(tree "$side")): $t exit status $? (build-ab-$side/$t.log)"
    done
    for case in "dense d64" "long causal gqa d128"; do
        compute-sanitizer --tool racecheck "build-ab-$side/tests/gpu/test_gpu_backward" \
            --case "$case" 2>&1 | grep "RACECHECK SUMMARY" |
            sed "s/^/change $side racecheck \"$case\": /"
    done
done
case " $phases " in *" bench "*) ;; *) exit 0 ;; esac
for round in 1 2; do
    for side in $sides; do
        echo "== $side: bench_bwd (TFLOP/s, ours / flash / cudnn)"
        PYTHONPATH=python FLASHATTN_LIBRARY="$PWD/build-ab-$side/libflashattn.so" \
            python3 tests/gpu/bench_bwd.py --hdims "$hdims" --seqlens "$seqlens" \
            --calls "${AB_CALLS:-1}" 2>&1 |
            grep -E "^ *[0-9]+ +[0-9]+ (True|False)"
    done
done
for round in 1 2; do
    for side in $sides; do
        echo "== $side: test_gpu_backward --bench"
        "build-ab-$side/tests/gpu/test_gpu_backward" --bench 2>&1 | grep "^bench"
    done
done
