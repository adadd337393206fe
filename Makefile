# The README's two commands, and the builds behind them. CMake does the work.
JOBS ?= $(shell nproc)

.PHONY: train test build build-asan build-clang build-cuda build-fuzz fuzz clean deps python

deps:
	@scripts/install-deps.sh

build: deps
	@cmake -S . -B build/release -DCMAKE_BUILD_TYPE=Release
	@cmake --build build/release -j$(JOBS)

build-asan: deps
	@cmake -S . -B build/asan -DCMAKE_BUILD_TYPE=RelWithDebInfo -DHT_SANITIZE=ON
	@cmake --build build/asan -j$(JOBS)

# clang, warning-free too (-Werror), built for x86-64-v3 (AVX2 + FMA) rather
# than this machine: the suite also runs on the code paths a CPU without
# AVX-512 takes, and the binary must run on any CPU the engine supports.
build-clang: deps
	@CC=clang cmake -S . -B build/clang -DCMAKE_BUILD_TYPE=Release -DHT_MARCH=x86-64-v3
	@cmake --build build/clang -j$(JOBS)

# The CUDA backend of the kernel table too (src/kernels/cuda/; nvcc and the
# CUDA toolkit's cuBLASLt, for the architectures in CUDA_ARCHS). It builds
# without a GPU; test_kernels then says the CUDA backend was not present.
CUDA_ARCHS ?= 80;90a
build-cuda: deps
	@cmake -S . -B build/cuda -DCMAKE_BUILD_TYPE=Release -DHT_CUDA=ON "-DHT_CUDA_ARCHITECTURES=$(CUDA_ARCHS)"
	@cmake --build build/cuda -j$(JOBS)

# libFuzzer targets (tests/fuzz/): clang, the library instrumented, ASan + UBSan.
build-fuzz: deps
	@CC=clang cmake -S . -B build/fuzz -DCMAKE_BUILD_TYPE=RelWithDebInfo -DHT_FUZZ=ON -DHT_MARCH=x86-64-v3
	@cmake --build build/fuzz -j$(JOBS)

# Every fuzz target for FUZZ_SECONDS (10 in the suite; for hours: make fuzz FUZZ_SECONDS=3600).
FUZZ_SECONDS ?= 10
fuzz: build-fuzz
	scripts/fuzz.sh $(FUZZ_SECONDS)

# Train the default model on the default corpus. STEPS=N trains N steps instead
# of the config's 300 (a quick pass through the whole path: the fresh-machine check).
STEPS ?=
train: build
	@scripts/train-default.sh $(if $(STEPS),--set training.steps=$(STEPS))

# The whole suite three times: the gcc release build for this CPU, the same
# tests under ASan + UBSan, and the portable clang build; then every fuzz
# target for FUZZ_SECONDS after replaying its regression inputs. A failed
# ctest prints its failed tests' failures again last (scripts/ctest-failures.sh),
# where the log's tail shows them.
test: build build-asan build-clang build-fuzz
	cd build/release && ctest --output-on-failure -j$(JOBS) || { ../../scripts/ctest-failures.sh .; exit 1; }
	cd build/asan && ASAN_OPTIONS=detect_leaks=1 ctest --output-on-failure -j$(JOBS) || { ../../scripts/ctest-failures.sh .; exit 1; }
	cd build/clang && ctest --output-on-failure -j$(JOBS) || { ../../scripts/ctest-failures.sh .; exit 1; }
	scripts/fuzz.sh $(FUZZ_SECONDS)

# The Python package (python/): hypertrain._C built with this CMake (-DHT_PYTHON=ON) and installed
# with hypertrain.optim and hypertrain.lr_scheduler into PYTHON's environment (README, From Python).
PYTHON ?= python3
python: deps
	$(PYTHON) -m pip install ./python

clean:
	rm -rf build
