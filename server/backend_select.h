// Picks the backend named by --backend (auto = cuda when a GPU is usable, else cpu).
#pragma once

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "server/backend.h"

namespace sds::server {

absl::StatusOr<std::unique_ptr<Backend>> CreateBackend(const std::string& which,
                                                       const BackendConfig& config);

}  // namespace sds::server
