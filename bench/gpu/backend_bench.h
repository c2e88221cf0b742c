// Backend-level cases of the GPU benchmark (backend_bench.cc): what the CUDA backend's
// Run costs per batch, outputs copied back vs written directly (cuda_backend.h).
#pragma once

#include <cuda_runtime_api.h>

#include <string>
#include <vector>

namespace sds::cudabench {

// Runs the backend cases named `only` ("backend": all of them), A/B/B/A over the two
// modes in this process, appending one table row per (case, mode) to `lines`. Returns false
// when a case failed (a CUDA or backend error, or outputs that differ between modes).
bool RunBackendCases(const std::string& only, cudaStream_t stream, std::vector<std::string>* lines);

}  // namespace sds::cudabench
