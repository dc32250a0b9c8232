#!/bin/sh
# profile_bwd.sh [profile_bwd.py ARGS...]: ncu's summary of the backward's main kernel (ours:
# fa_bwd; with --impl cudnn, cuDNN's) for one call of tests/gpu/profile_bwd.py: duration; the
# multiprocessors' active cycles, average against the busiest (their ratio is the share of the
# run the average SM worked: what the grid's tail and imbalance leave idle); the L2's load and
# its reduction sectors (dQ's additions); the L1's load and its shared-memory wavefronts (which
# count wgmma's operand reads); instructions, those of the uniform pipe among them; and the warp
# stalls per issued instruction, the larger ones (over 0.1). Needs a build in build-cuda (the
# library target is enough: the kernels are compiled at first use). Clocks are left to the GPU,
# as in the benchmarks.
set -u
case " $* " in
*" --impl cudnn "*) kernel="regex:bprop" ;;
*) kernel="regex:^fa_bwd$" ;;
esac
metrics="gpu__time_duration.sum,sm__cycles_active.avg,sm__cycles_active.max"
metrics="$metrics,lts__throughput.avg.pct_of_peak_sustained_elapsed,lts__t_sectors_op_red.sum"
metrics="$metrics,l1tex__throughput.avg.pct_of_peak_sustained_active"
metrics="$metrics,l1tex__data_pipe_lsu_wavefronts_mem_shared.sum"
metrics="$metrics,smsp__inst_executed.sum,sm__inst_executed_pipe_uniform.sum"
metrics="$metrics,regex:smsp__average_warps_issue_stalled_.*_per_issue_active.ratio"
PYTHONPATH=${PYTHONPATH:-python} FLASHATTN_LIBRARY=${FLASHATTN_LIBRARY:-$PWD/build-cuda/libflashattn.so} \
    ncu --clock-control none --profile-from-start off -k "$kernel" --metrics "$metrics" \
    python3 tests/gpu/profile_bwd.py "$@" 2>&1 |
    awk '/^  [a-zA-Z_].*\(/ || (/ [a-z0-9_]+__/ && !/issue_stalled/) || (/issue_stalled/ && $NF + 0 > 0.1)' |
    sed -e 's/  */ /g' -e 's/smsp__average_warps_issue_stalled_\(.*\)_per_issue_active.ratio/stall \1/'
