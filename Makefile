# Thin wrapper over CMake. The two commands a new user needs:
#   make run    build, then run a representative benchmark on the best backend present
#   make test   build, then run every test (C tests through ctest, Python tests through pytest)

BUILD_DIR ?= build
PYTHON ?= python3
JOBS ?= $(shell nproc 2>/dev/null || echo 2)
SHARDS ?= $(JOBS)
CMAKE_FLAGS ?=

.PHONY: all build run test test-c test-python test-upstream python-deps clean gpu-check gpu-build \
	gpu-tests gpu-python gpu-upstream gpu-tune spill-check

all: build

build:
	cmake -S . -B $(BUILD_DIR) -DCMAKE_BUILD_TYPE=Release $(CMAKE_FLAGS)
	cmake --build $(BUILD_DIR) -j $(JOBS)
	ln -sf $(abspath $(BUILD_DIR))/libflashattn.so python/flashattn/libflashattn.so
	if [ -f $(BUILD_DIR)/_fastpath.abi3.so ]; then \
		ln -sf $(abspath $(BUILD_DIR))/_fastpath.abi3.so python/flashattn/_fastpath.abi3.so; fi

run: build
	$(BUILD_DIR)/flashattn bench --batch 1 --heads 16 --seqlen 2048 --head-dim 128 --dtype fp32

test: build test-c test-python test-upstream

test-c: build
	cd $(BUILD_DIR) && ctest --output-on-failure -j $(JOBS)

# The Python tests need numpy, pytest, torch (CPU is enough), ml_dtypes, einops (upstream's
# tests import it) and transformers (tests/python/test_transformers.py); install them when
# missing.
python-deps:
	@$(PYTHON) -c "import numpy, pytest, torch, ml_dtypes, einops, transformers" 2>/dev/null || \
		$(PYTHON) -m pip install -q -r tests/python/requirements.txt

test-python: build python-deps
	PYTHONPATH=python $(PYTHON) -m pytest -q tests/python

# Upstream's tests/test_flash_attn.py through the flash_attn alias, a fixed sample on CPU tensors
# (tests/upstream/conftest.py; FLASHATTN_UPSTREAM_CASES=all FLASHATTN_UPSTREAM_MAX_WORK=all runs
# every case). Its own pytest process: the alias must not reach tests/python.
test-upstream: build python-deps
	$(PYTHON) -m pytest -q tests/upstream

# On a CUDA machine: build in build-cuda, run the GPU tests (GPU vs CPU on every feature, in C,
# each suite in SHARDS processes side by side, since their single-threaded double-precision
# references take the time; and through the Python functions on CUDA tensors), then benchmark
# beside PyTorch's SDPA backends: host cost per call, a decoding step, the forward's table last.
# Exits with the tests' status. gpu-build, gpu-tests, gpu-python and gpu-upstream are its parts,
# for machines that limit how long one command may run.
# The sm_90a kernels of every aligned feature set at the precompile matrix's head dims and
# dtypes, compiled into a cache (NVRTC, no GPU; minutes on few cores; SPILL_CACHE=DIR reuses and
# keeps one, else a fresh one), then a failure when a Hopper kernel touches local memory or
# serialises its wgmmas (tools/check_spills.py; cuobjdump from $CUOBJDUMP, PATH, $CUDA_HOME or
# the pip wheel).
SPILL_FEATURES ?= none,varlen,alibi,softcap,dropout,varlen+alibi,varlen+softcap,varlen+dropout,alibi+softcap,alibi+dropout,varlen+alibi+softcap,varlen+alibi+dropout
SPILL_SOURCES ?= fa_fwd_sm90.cu,fa_bwd_sm90.cu,fa_bwd_sm90_wide.cu
SPILL_CACHE ?=
spill-check: build
	d=$(or $(SPILL_CACHE),$$(mktemp -d)) && FLASHATTN_CACHE_DIR=$$d $(BUILD_DIR)/flashattn \
		precompile --arch sm_90a --features $(SPILL_FEATURES) --jobs $(JOBS) && \
		$(PYTHON) tools/check_spills.py $$d --spills --check --source $(SPILL_SOURCES); \
		rc=$$?; [ -n "$(SPILL_CACHE)" ] || rm -rf $$d; exit $$rc

gpu-check: gpu-build
	$(MAKE) --no-print-directory gpu-tests; rc=$$?; \
	$(MAKE) --no-print-directory gpu-python || rc=1; \
	$(MAKE) --no-print-directory gpu-upstream || rc=1; exit $$rc

gpu-build:
	cmake -S . -B build-cuda -DCMAKE_BUILD_TYPE=Release $(CMAKE_FLAGS)
	cmake --build build-cuda -j $(JOBS)
	if [ -f build-cuda/_fastpath.abi3.so ]; then \
		ln -sf $(abspath build-cuda)/_fastpath.abi3.so python/flashattn/_fastpath.abi3.so; fi
	build-cuda/flashattn info

gpu-tests:
	tests/gpu/run_sharded.sh $(SHARDS) build-cuda/tests/gpu/test_gpu_forward; rc=$$?; \
	tests/gpu/run_sharded.sh $(SHARDS) build-cuda/tests/gpu/test_gpu_sm90 || rc=1; \
	tests/gpu/run_sharded.sh $(SHARDS) build-cuda/tests/gpu/test_gpu_backward || rc=1; \
	tests/gpu/run_sharded.sh $(SHARDS) build-cuda/tests/gpu/test_gpu_kvcache || rc=1; \
	build-cuda/tests/gpu/test_gpu_kvcache_check || rc=1; \
	tests/gpu/run_sharded.sh $(SHARDS) build-cuda/tests/gpu/test_gpu_mod || rc=1; \
	build-cuda/tests/gpu/test_gpu_block_mask || rc=1; \
	exit $$rc

gpu-python:
	export PYTHONPATH=python FLASHATTN_LIBRARY=$(abspath build-cuda)/libflashattn.so; \
	$(PYTHON) -m pytest -q tests/gpu/test_python_cuda.py tests/gpu/test_ring_cuda.py \
	  tests/gpu/test_flex_aux_grad_cuda.py \
	  tests/python/test_transformers.py tests/python/test_compat.py; rc=$$?; \
	$(PYTHON) tests/gpu/bench_overhead.py || rc=1; \
	$(PYTHON) bench/decode_gpu.py --batch 1,8,32 --context 1k,32k || rc=1; \
	$(PYTHON) tests/gpu/bench_gpu.py || rc=1; exit $$rc

# Upstream's tests/test_flash_attn.py on CUDA tensors, a larger sample than the CPU's
# (FLASHATTN_UPSTREAM_CASES per test; about six minutes on an H200, most of it compiling each
# new kernel configuration on first use).
gpu-upstream:
	export FLASHATTN_LIBRARY=$(abspath build-cuda)/libflashattn.so FLASHATTN_UPSTREAM_DEVICE=cuda; \
	$(PYTHON) -m pytest -q tests/upstream

# On a CUDA machine, after gpu-check's build: the Hopper rows' plans timed beside the
# alternatives they were chosen over (FLASHATTN_SM90_TILE=BN,STAGES,PINGPONG,PERSISTENT,CONSUMERS:
# one CTA per causal tile; two consumer warpgroups at head dim 64 on long calls, three on short;
# d 192 / dv 128 beside the sm80 family and d 192's own 112-key block), then the backward, the
# sm80 family (FLASHATTN_BWD_SM90=0) beside the sm90 one (the default).
gpu-tune:
	export PYTHONPATH=python FLASHATTN_LIBRARY=$(abspath build-cuda)/libflashattn.so; \
	$(PYTHON) tests/gpu/bench_gpu.py --no-jit --no-sm80 --hdims 64 \
		--variants "128,4,0,1,2;128,4,0,2,2;128,4,0,2,3" && \
	$(PYTHON) tests/gpu/bench_gpu.py --no-jit --no-sm80 --hdims 128 --variants "128,2,1,1" && \
	$(PYTHON) tests/gpu/bench_gpu.py --no-jit --no-sm80 --hdims 256 --variants "80,2,1,1" && \
	$(PYTHON) tests/gpu/bench_gpu.py --no-jit --hdims 192 --dv 128 --variants "112,2,1" && \
	FLASHATTN_BWD_SM90=0 $(PYTHON) tests/gpu/bench_bwd.py && \
	$(PYTHON) tests/gpu/bench_bwd.py

clean:
	rm -rf $(BUILD_DIR) python/flashattn/libflashattn.so
