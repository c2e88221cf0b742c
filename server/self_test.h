// Start-up self-test: a small real prefill + decode through the batcher and the
// backend, checked against values computed on the host. Health turns SERVING only
// after it passed.
//
// The inputs make the check exact up to bf16 rounding: q = 0 gives uniform scores, so
// out[h] = mean over the selected tokens of V[t, h/G] * sigmoid(gate[h]); V values are
// chosen so that their FP8 quantisation is exact in both scale modes, and differ per
// KV head so a wrong head mapping (h % Hkv) fails the test.
#pragma once

#include "absl/status/status.h"
#include "paged_cache/paged_kv_cache.h"
#include "server/batcher.h"
#include "server/model_shape.h"

namespace sds::server {

absl::Status RunSelfTest(Batcher& batcher, PagedKvCache& cache, const ModelShape& model);

}  // namespace sds::server
