# The README's two commands: `make demo` and `make test`. Both install what is missing.
BUILD ?= build
JOBS ?= $(shell nproc)
CMAKE_FLAGS ?=

.PHONY: all deps configure build test demo lint format bench-cpu gpu-bundle clean

all: build

deps:
	bash scripts/install_deps.sh

configure: deps
	cmake -S . -B $(BUILD) -G Ninja $(CMAKE_FLAGS)

build: configure
	cmake --build $(BUILD) -j $(JOBS)

test: build
	cd $(BUILD) && ctest --output-on-failure -j $(JOBS)

demo: build
	bash scripts/demo.sh $(BUILD)

lint: configure
	bash scripts/lint.sh $(BUILD)

format:
	clang-format -i $$(git ls-files '*.h' '*.cc' '*.cu' '*.cuh')

bench-cpu: build
	bash bench/run_cpu_bench.sh $(BUILD)

gpu-bundle: build
	bash scripts/gpu_bundle.sh $(BUILD)

clean:
	rm -rf $(BUILD)
