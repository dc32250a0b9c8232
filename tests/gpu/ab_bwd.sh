#!/bin/sh
# ab_bwd.sh BASE_DIR CHANGE_DIR [HDIMS [SEQLENS]]: the backward of two source trees side by
# side, for a kernel change's A/B in one device call. Each tree is built (build-ab-base,
# build-ab-change) and timed through the same Python tree (this checkout's python/), so only
# the library differs: the change's backward tests (16 shards) and racecheck on two cases, then
# tests/gpu/bench_bwd.py for base, change, base, change (alternated: the GPU's state drifts
# between runs by as much as a small change is worth), and `test_gpu_backward --bench` the
# same way. The device's copy of the checkout has no .git: export the other tree first, into a
# directory the copy carries, e.g.
#
#     git archive main | tar -x -C .wt/base        # here
#     tests/gpu/ab_bwd.sh .wt/base . 64 2048,4096  # on the device
set -u
hdims=${3:-64,128}
seqlens=${4:-2048,4096,8192}
for side in base change; do
    src=$1
    [ "$side" = change ] && src=$2
    (cmake -S "$src" -B "build-ab-$side" -DCMAKE_BUILD_TYPE=Release >/dev/null &&
     cmake --build "build-ab-$side" -j 8 >"build-ab-$side.log" 2>&1 ||
     echo "$side ($src): build failed, see build-ab-$side.log") &
done
wait
test -f build-ab-base/libflashattn.so && test -f build-ab-change/libflashattn.so || exit 1
FA_SHARD_TIMEOUT=${FA_SHARD_TIMEOUT:-240} tests/gpu/run_sharded.sh 16 \
    build-ab-change/tests/gpu/test_gpu_backward >build-ab-change/tests.log 2>&1
echo "change's test_gpu_backward: exit status $? (build-ab-change/tests.log)"
for case in "dense d64" "long causal gqa d128"; do
    compute-sanitizer --tool racecheck build-ab-change/tests/gpu/test_gpu_backward \
        --case "$case" 2>&1 | grep "RACECHECK SUMMARY" | sed "s/^/racecheck \"$case\": /"
done
for side in base change base change; do
    echo "== $side: bench_bwd (TFLOP/s, ours / flash / cudnn)"
    PYTHONPATH=python FLASHATTN_LIBRARY="$PWD/build-ab-$side/libflashattn.so" \
        python3 tests/gpu/bench_bwd.py --hdims "$hdims" --seqlens "$seqlens" 2>&1 |
        grep -E "^ *[0-9]+ +[0-9]+ (True|False)"
done
for side in base change base change; do
    echo "== $side: test_gpu_backward --bench"
    "build-ab-$side/tests/gpu/test_gpu_backward" --bench 2>&1 | grep "^bench"
done
