#!/bin/sh
# profile_bwd.sh [profile_bwd.py ARGS...]: ncu's summary of the backward's main kernel (ours:
# fa_bwd; with --impl cudnn, cuDNN's) for one call of tests/gpu/profile_bwd.py: duration, the
# tensor pipe's share, warp states, and the multiprocessors' active cycles, average against
# the busiest (their ratio is the share of the run the average SM worked: what the grid's tail
# and imbalance leave idle). Needs a build in build-cuda (the library target is enough: the
# kernels are compiled at first use). Clocks are left to the GPU, as in the benchmarks.
set -u
case " $* " in
*" --impl cudnn "*) kernel="regex:bprop" ;;
*) kernel="regex:^fa_bwd$" ;;
esac
PYTHONPATH=${PYTHONPATH:-python} FLASHATTN_LIBRARY=${FLASHATTN_LIBRARY:-$PWD/build-cuda/libflashattn.so} \
    ncu --clock-control none --profile-from-start off -k "$kernel" \
    --section SpeedOfLight --section WarpStateStats --section Occupancy \
    --metrics sm__cycles_active.avg,sm__cycles_active.max,sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active \
    python3 tests/gpu/profile_bwd.py "$@" 2>&1 |
    grep -E "^  [a-zA-Z_].*\(|Duration|Pipe Tensor|Issue Slots Busy|Warp Cycles Per Issued|Achieved Active Warps|Stall (Long|Wait|Barrier|Short|MIO)|sm__cycles_active|gmma_cycles" |
    sed 's/  */ /g'
