// Plain parameter struct of the CUDA sparse decode kernel (device pointers) and its
// fixed tiling constants. Built by decode.cu from a CacheView + DecodeBatch.
#pragma once

#include <cstdint>

namespace sds::cuda {

// Tokens of one request (one index list) handled by one CTA. Fixed, so the split of
// the K dimension depends on the request alone (batch invariance). Part of the
// arithmetic like the warp count: `cmake -DSDS_DECODE_CHUNK_TOKENS=256` (or 128) builds
// the experiment variants of bench/RESULTS.md (host code and kernels alike), never a
// per-launch choice.
#ifndef SDS_DECODE_CHUNK_TOKENS
#define SDS_DECODE_CHUNK_TOKENS 512
#endif
inline constexpr int kDecodeChunkTokens = SDS_DECODE_CHUNK_TOKENS;
// Warp sequences per CTA (one warp each; two in the PV-warp CTAs of small grids). Each
// sequence runs its own online softmax over steps s, s + W, ... of the chunk and the CTA
// merges the W sequences in a fixed order, so W is part of the arithmetic: it is fixed
// at build time, never chosen per launch.
#ifndef SDS_DECODE_WARPS
#define SDS_DECODE_WARPS 4
#endif
inline constexpr int kDecodeWarps = SDS_DECODE_WARPS;
static_assert(kDecodeWarps == 4 || kDecodeWarps == 8, "decode warps per CTA");
inline constexpr int kDecodeThreads = kDecodeWarps * 32;
static_assert(kDecodeChunkTokens % kDecodeThreads == 0, "whole chunk tokens per thread");
inline constexpr int kDecodeStepTokens = 16;  // tokens per warp step (one MMA K-tile)
inline constexpr int kDecodeMaxGroup = 16;    // query heads per KV head (MMA M = 16)
inline constexpr int kDecodeStatFloats = 4;   // per (chunk, head): max_s, max_u, l, pad
// Chunks per request (top-K up to 65536): the last CTA keeps a merge factor per (head,
// chunk) in shared memory.
inline constexpr int kDecodeMaxChunks = 128;

// v2 kernel (decode_v2_kernel.cuh): the top-K list is cut into fixed units of
// kDecodeUnitTokens indices; a unit's partial is computed by one warp per KV head in
// kDecodeUnitSteps 16-token steps, and a request's units are folded left to right.
inline constexpr int kDecodeUnitTokens = 64;
inline constexpr int kDecodeUnitSteps = kDecodeUnitTokens / kDecodeStepTokens;
inline constexpr int kDecodeV2MaxHeads = 8;  // KV heads (= warps) per v2 CTA
// The fine split (one CTA per unit) is used for batches of at most this many units
// (requests x units of the longest list) and sized into DecodeWorkspaceFloats.
inline constexpr int kDecodeV2FineMaxUnits = 1024;

// v1: batches of at most this many requests carry each request's scalars in the kernel
// parameters (DecodeParams::req, constant bank) instead of global memory, so the CTA's
// first dependent global load (top-K, layer, offsets) leaves the chain
// topk -> index list -> page table -> K/V of a small batch.
inline constexpr int kDecodeInlineRequests = 16;

// One request's scalars (the [B] arrays of DecodeParams, row b).
struct DecodeRequestScalars {
  int64_t index_offset;
  int64_t page_table_offset;
  int32_t topk;
  int32_t layer;
  int32_t indices_per_kv_head;
  int32_t pad;
};

struct DecodeParams {
  // Cache. k, v: [L, P, page_size, Hkv, D] FP8 bytes.
  const uint8_t* k;
  const uint8_t* v;
  // k_token_scale, v_token_scale: [L, P, page_size, Hkv] float (per_token_head mode).
  const float* k_token_scale;
  const float* v_token_scale;
  // layer_k_scale, layer_v_scale: [L] float (per_tensor mode).
  const float* layer_k_scale;
  const float* layer_v_scale;
  int64_t layer_elements;  // P * page_size * Hkv * D
  int64_t layer_scales;    // P * page_size * Hkv
  int32_t num_kv_heads;    // Hkv
  int32_t page_size;       // power of two
  int32_t page_shift;      // log2(page_size)

  // Batch.
  int32_t num_q_heads;  // Hq
  int32_t group;        // G = Hq / Hkv, 1..16
  // q, gate: [B, Hq, D] bf16 bits.
  const uint16_t* q;
  const uint16_t* gate;
  const int32_t* layer;                // [B]
  const int32_t* page_table;           // flat; request b's page j at [page_table_offset[b] + j]
  const int64_t* page_table_offset;    // [B]
  const int32_t* indices;              // flat; [K_b] or [Hkv, K_b] from index_offset[b]
  const int64_t* index_offset;         // [B]
  const int32_t* topk;                 // [B]
  const uint8_t* indices_per_kv_head;  // [B]
  uint16_t* out;                       // [B, Hq, D] bf16 bits
  float* lse;                          // [B, Hq] or nullptr

  // Split-K workspace (used when a request has more than one chunk and the launch does
  // not merge in clusters, see cluster_merge).
  // partial_o: [B, Hkv, max_chunks, G, D] f32 unnormalised outputs.
  float* partial_o;
  // partial_stats: [B, Hkv, max_chunks, G, kDecodeStatFloats] f32.
  float* partial_stats;
  // counters: [B, Hkv] int32, zero between launches (the last CTA resets its counter).
  int32_t* counters;
  int32_t max_chunks;
  float score_scale_log2;  // log2(e) / sqrt(D)
  // v1: set by the launch when it uses clusters of max_chunks CTAs along y (callers set
  // it to allow that: 1 for grids of at most one CTA per SM, 2 at any grid size): the
  // chunks of a request push their partials into chunk 0's shared memory instead of
  // partial_o / counters.
  int32_t cluster_merge;

  // v2 only. heads_per_cta: KV heads (one warp each) per CTA, a power of two dividing
  // Hkv. fine: one CTA per unit, unit partials go to partial_o / partial_stats laid out
  // [B, Hkv, max_units, G, D] and [B, Hkv, max_units, G, kDecodeStatFloats], folded by
  // the merge kernel; otherwise one CTA walks all units of its request and KV heads.
  int32_t heads_per_cta;
  int32_t fine;
  int32_t max_units;  // ceil(max_topk / kDecodeUnitTokens), >= 1

  // v1 only. inline_requests: 1 when req[0 .. B) holds the batch's per-request scalars
  // (B <= kDecodeInlineRequests); the kernel then never reads layer, page_table_offset,
  // index_offset, topk or indices_per_kv_head from global memory.
  int32_t inline_requests;
  DecodeRequestScalars req[kDecodeInlineRequests];
};

}  // namespace sds::cuda
