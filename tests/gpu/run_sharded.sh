#!/bin/sh
# run_sharded.sh N TEST [ARGS...]: runs TEST as N processes side by side, process i with
# FA_TEST_SHARD=i/N (each a disjoint share of the cases), prints their outputs in order and
# exits 0 only if every shard passed (77, skipped, if every shard skipped). The library's CPU
# backend runs on one thread in each (FLASHATTN_NUM_THREADS=1): the shards fill the cores.
# FA_SHARD_TIMEOUT=S stops a shard after S seconds (a hung kernel then fails the run instead
# of holding it; 0 or unset: no limit).
n=$1
shift
dir=$(mktemp -d)
limit=${FA_SHARD_TIMEOUT:-0}
i=0
while [ "$i" -lt "$n" ]; do
    (FA_TEST_SHARD="$i/$n" FLASHATTN_NUM_THREADS=1 timeout "$limit" "$@" >"$dir/out.$i" 2>&1
     echo $? >"$dir/rc.$i") &
    i=$((i + 1))
done
wait
rc=0
skipped=0
i=0
while [ "$i" -lt "$n" ]; do
    cat "$dir/out.$i"
    r=$(cat "$dir/rc.$i")
    if [ "$r" = 77 ]; then
        skipped=$((skipped + 1))
    elif [ "$r" != 0 ]; then
        echo "shard $i/$n of $1: exit status $r"
        rc=1
    fi
    i=$((i + 1))
done
rm -rf "$dir"
[ "$rc" = 0 ] && [ "$skipped" = "$n" ] && exit 77
exit $rc
