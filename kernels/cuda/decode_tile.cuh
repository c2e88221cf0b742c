// Tiling and shared-memory map of the v1 sparse decode kernel (SparseDecodeKernel in
// decode_kernel.cuh): ring depths, the DecodeTile layout of one CTA's shared memory and
// its bank-conflict swizzles. Device code only.
#pragma once

#include <cstdint>

#include "kernels/cuda/decode_params_cuda.h"

namespace sds::cuda {

// cp.async ring depth per warp sequence for head_dim 128 (one warp per sequence; PV-warp
// CTAs take one more): 3 stages fit 4 CTAs per SM, which
// measured 5% faster than 4 stages and 3 CTAs per SM on the H200 (bench/RESULTS.md).
inline constexpr int kDecodeDefaultStagesD128 = 3;
// Ring depth of head_dim D (the kernel takes it as a template argument).
template <int D>
inline constexpr int kDecodeDefaultStages = D == 256 ? 2
                                                     : (D == 128 ? kDecodeDefaultStagesD128 : 4);

// One step's hand-off from a sequence's softmax warp to its PV warp (kPvWarp): lane l's
// P^T fragments {pa0, pa2, pl0, pl2} and rescale factors of heads 2 tig, 2 tig + 1.
// Structure of arrays, so that a warp's 16-byte and 8-byte accesses are contiguous (a
// 32-byte lane stride cost 2-way bank conflicts).
struct DecodePSlot {
  uint4 p[32];
  uint2 alpha[32];
};

// kPvWarpT: each warp sequence has a second warp that runs its P*V (G <= 8 only; see
// SparseDecodeKernel). The arithmetic does not depend on it.
template <int D, int kRows, bool kPerToken, int kStagesT, bool kPvWarpT = false>
struct DecodeTile {
  static_assert(D == 64 || D == 128 || D == 256, "head_dim");
  static_assert(kRows == 8 || kRows == 16, "group tile");
  static_assert(kStagesT >= (kPvWarpT ? 3 : 2), "ring depth");
  static_assert(!kPvWarpT || kRows == 8, "the PV warp needs the transposed PV (G <= 8)");
  static constexpr int kStages = kStagesT;
  static constexpr bool kPvWarp = kPvWarpT;
  static constexpr int kWarps = kDecodeWarps * (kPvWarp ? 2 : 1);  // warps per CTA
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kRowChunks = D / 16;                      // 16-byte pieces of a row
  static constexpr int kStageBytes = 2 * kDecodeStepTokens * D;  // K rows, then V rows
  static constexpr int kRingBytes = kDecodeWarps * kStages * kStageBytes;
  static constexpr int kKSteps = D / 16;  // QK MMA k-steps
  static constexpr int kPvTiles = D / 8;  // PV MMA n-tiles
  // Q fragment words per lane and k-step: 4 (A operand, heads g and g + 8; G > 8), or 2
  // (G <= 8: the B operand Q^T of QK, head grp's k-pairs 2tig and 2tig + 8).
  static constexpr int kQFragWords = kRows == 16 ? 4 : 2;
  static constexpr int kQFragBytes = kKSteps * 32 * kQFragWords * 4;
  static constexpr int kTableBytes = kDecodeChunkTokens * 4;
  // Shared memory map (bytes). Without PV warps it fits 4 CTAs per SM at head_dim 128 and
  // G <= 8 in both scale modes (57344 bytes per CTA plus the 1 KB the driver reserves:
  // 228 KB per SM); PV-warp CTAs (a deeper ring and the P slots) fit 2.
  // uint2/uint4 [kKSteps][32]: the f16 Q fragments of the QK MMAs.
  static constexpr int kQFragOffset = kRingBytes;
  static constexpr int kRowsOffset = kQFragOffset + kQFragBytes;  // int32 [chunk]
  static_assert(kRowsOffset % 16 == 0, "row numbers are read as int2 / int4");
  static constexpr int kKfOffset = kRowsOffset + kTableBytes;                  // float [chunk]
  static constexpr int kVlOffset = kKfOffset + (kPerToken ? kTableBytes : 0);  // float [chunk]
  static constexpr int kTablesEnd = kVlOffset + (kPerToken ? kTableBytes : 0);
  // After the main loop the ring is scratch: [sequences][G <= kRows][D] f32 outputs,
  // then (where they fit) the merge statistics, which otherwise follow the tables.
  static constexpr int kScratchBytes = kDecodeWarps * kRows * D * 4;
  static_assert(kScratchBytes <= kRingBytes, "scratch");
  static constexpr int kStatsBytes = kDecodeWarps * kDecodeMaxGroup * 4 * 4;   // [seq][16][4]
  static constexpr int kHeadBytes = kDecodeMaxGroup * (4 + kDecodeWarps) * 4;  // [16][4 + W]
  static constexpr int kFlagBytes = 16;  // the last-CTA flag (int)
  static constexpr int kPostBytes = kStatsBytes + kHeadBytes + kFlagBytes;
  static constexpr bool kPostInRing = kScratchBytes + kPostBytes <= kRingBytes;
  static constexpr int kStatsOffset = kPostInRing ? kScratchBytes : kTablesEnd;
  static constexpr int kHeadOffset = kStatsOffset + kStatsBytes;
  static constexpr int kFlagOffset = kHeadOffset + kHeadBytes;
  // P hand-off (kPvWarp, main loop only): DecodePSlot [sequence][step parity].
  static constexpr int kPSlotOffset = kPostInRing ? kTablesEnd : kTablesEnd + kPostBytes;
  static constexpr int kPSlotBytes = kPvWarp ? kDecodeWarps * 2 * sizeof(DecodePSlot) : 0;
  static_assert(kPSlotOffset % 16 == 0, "P slot alignment");
  static constexpr int kSmemBytes = kPSlotOffset + kPSlotBytes;
  // Per-warp max |q| during the prologue: the last ring slot of the last sequence, which
  // the prologue does not fill (it issues stages 0 .. kStages - 2 at most).
  static constexpr int kQMaxOffset = kRingBytes - 4 * kWarps;
  static_assert(4 * kWarps <= kStageBytes, "q max slots");
  // Split-K merge factors of the last CTA, [16][chunks] + [16][4] f32, from ring start
  // (the sequences' outputs are consumed by then; kMergeMaxChunks keeps them in the ring
  // and clear of the flag).
  static constexpr int kMergeMaxChunks =
      ((kPostInRing ? kFlagOffset : kRingBytes) / 4 - kDecodeMaxGroup * 4) / kDecodeMaxGroup;
  static_assert(kMergeMaxChunks >= kDecodeMaxChunks, "merge factors");
  // Cluster merge (p.cluster_merge): chunk 0's receive area, after the layout above and
  // only in cluster launches (the launch adds ClusterRecvBytes(max_chunks) to the dynamic
  // shared memory). Every other chunk CTA pushes its partial and statistics there with
  // st.async, counted by the area's mbarrier, while chunk 0 may still be in its main loop
  // (so the area is its own, not the ring). Map (bytes from kSmemBytes):
  //   mbarrier (8, padded to 16); stats [chunks][16][4] f32; partials [chunks][G * D] f32
  // (chunk 0 writes its own slot 0 locally).
  static constexpr int kClusterStatsBytes = kDecodeMaxGroup * kDecodeStatFloats * 4;
  __host__ __device__ static constexpr int ClusterRecvBytes(int chunks) {
    return 16 + chunks * (kClusterStatsBytes + kRows * D * 4);
  }
  // The largest cluster (8 CTAs, portable) must fit the opt-in shared memory per CTA.
  static constexpr int kMaxClusterChunks = 8;
  static constexpr int kMaxSmemPerCta = 227 * 1024;
  static constexpr bool kClusterMergeFits =
      kSmemBytes % 16 == 0 && kSmemBytes + ClusterRecvBytes(kMaxClusterChunks) <= kMaxSmemPerCta;
  // Q fragments built per thread (the last round may leave threads idle).
  static constexpr int kQFragPerThread = (kKSteps * 32 + kThreads - 1) / kThreads;

  // Column of (head g, column d) in a row of the per-warp output scratch (G > 8). MMA
  // thread (grp = g % 8, tig) holds columns (2 tig + c) * D/8 + j, which for fixed (c, j) all
  // fall in one bank (a 32-way conflict per store); the XOR with (grp, tig) spreads a
  // warp's stores over the banks and keeps d within its D/4 block (tig's bits).
  __device__ static __forceinline__ int OutCol(int g, int d) {
    constexpr int kMask = (D / 4 < 32 ? D / 4 : 32) - 1;
    return d ^ (((g & 7) * 4 + d / (D / 4)) & kMask);
  }

  // Column of (head g, column d) in the output scratch when PV runs transposed (G <= 8):
  // thread (grp, tig) holds columns grp * D/8 + [0, D/8) of heads 2 tig, 2 tig + 1; the
  // XOR with (grp, tig) spreads a warp's stores over the banks and keeps d in its block.
  __device__ static __forceinline__ int OutColT(int g, int d) {
    constexpr int kBlock = D / 8 < 32 ? D / 8 : 32;  // XOR range
    constexpr int kPer = 32 / kBlock;                // d blocks per 32 banks
    return d ^ ((((d / (D / 8)) / kPer) * 4 + (g >> 1)) & (kBlock - 1));
  }

  // Column of (head g, column d) in the output scratch for the PV layout in use.
  template <bool kTransposedPv>
  __device__ static __forceinline__ int ScratchCol(int g, int d) {
    return kTransposedPv ? OutColT(g, d) : OutCol(g, d);
  }

  // 16-byte piece `chunk` of ring row `row`, XOR-swizzled against bank conflicts.
  __device__ static __forceinline__ int Piece(int row, int chunk) {
    constexpr int kMask = kRowChunks >= 8 ? 7 : kRowChunks - 1;
    return row * D + ((chunk ^ (row & kMask)) << 4);
  }
};

}  // namespace sds::cuda
