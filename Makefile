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

# clang-tidy needs the generated gRPC headers (decode.pb.h, decode.grpc.pb.h): build
# the proto library, not the whole tree. It lints the files in the build's
# compile_commands.json (a CPU-only build skips the CUDA-side sources, and says so).
lint: configure
	cmake --build $(BUILD) -j $(JOBS) --target sds_proto
	bash scripts/lint.sh $(BUILD)

format:
	clang-format -i $$(git ls-files '*.h' '*.cc' '*.cu' '*.cuh')

bench-cpu: build
	bash bench/run_cpu_bench.sh $(BUILD)

gpu-bundle: build
	bash scripts/gpu_bundle.sh $(BUILD)

clean:
	rm -rf $(BUILD)
