# The README's two commands, and the builds behind them. CMake does the work.
JOBS ?= $(shell nproc)

.PHONY: train test build build-asan build-clang clean deps

deps:
	@scripts/install-deps.sh

build: deps
	@cmake -S . -B build/release -DCMAKE_BUILD_TYPE=Release >/dev/null
	@cmake --build build/release -j$(JOBS)

build-asan: deps
	@cmake -S . -B build/asan -DCMAKE_BUILD_TYPE=RelWithDebInfo -DHT_SANITIZE=ON >/dev/null
	@cmake --build build/asan -j$(JOBS)

# clang must compile everything warning-free too (-Werror); the tests run on the gcc builds.
build-clang: deps
	@CC=clang cmake -S . -B build/clang -DCMAKE_BUILD_TYPE=Release >/dev/null
	@cmake --build build/clang -j$(JOBS)

# Train the default model on the default corpus.
train: build
	@scripts/train-default.sh

# The whole suite: the release build, then the same tests under ASan + UBSan,
# and a clang build that must compile cleanly.
test: build build-asan build-clang
	cd build/release && ctest --output-on-failure -j$(JOBS)
	cd build/asan && ASAN_OPTIONS=detect_leaks=1 ctest --output-on-failure -j$(JOBS)

clean:
	rm -rf build
