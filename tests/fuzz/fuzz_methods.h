// The methods of fuzz_service.cc, by the number its input's selector picks (selector %
// kNumMethods); make_corpus.cc frames its seeds with the same numbers.
#pragma once

namespace sds::fuzz {

enum Method {
  kGetModelInfo,
  kCreateSequence,
  kAppendKV,
  kDecode,
  kDecodeBatch,
  kDecodeStream,
  kForkSequence,
  kReleaseSequence,
  kRegisterRegion,
  kUnregisterRegion,
  kListRegions,
  kDecodeLayer,
  kDecodeLayerStream,
  kNumMethods
};

// The names in the service's paths (/sparse_decode.v1.DecodeService/<name>).
inline constexpr const char* kMethodNames[kNumMethods] = {
    "GetModelInfo", "CreateSequence", "AppendKV",         "Decode",         "DecodeBatch",
    "DecodeStream", "ForkSequence",   "ReleaseSequence",  "RegisterRegion", "UnregisterRegion",
    "ListRegions",  "DecodeLayer",    "DecodeLayerStream"};

}  // namespace sds::fuzz
