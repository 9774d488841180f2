// twofour: CUTLASS 3.x sm90 2:4 sparse GEMM types shared by the launcher and the compressor.
// D (M x N, column-major, i.e. Y = (N, M) row-major) = A (M x K, 2:4, row-major) @ B (K x N,
// K-contiguous, i.e. X = (N, K) row-major); bf16 in and out, fp32 accumulation.
#pragma once
#include <cstdint>
#include <cuda_runtime.h>

#include "cutlass/cutlass.h"
#include "cute/tensor.hpp"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/util/packed_stride.hpp"

namespace twofour_sm90 {
using namespace cute;

#ifndef TWOFOUR_ELEMENT
#define TWOFOUR_ELEMENT cutlass::bfloat16_t
#endif
using Element = TWOFOUR_ELEMENT;
using ElementOut = cutlass::bfloat16_t;
using LayoutA = cutlass::layout::RowMajor;
using LayoutB = cutlass::layout::ColumnMajor;
using LayoutD = cutlass::layout::ColumnMajor;
constexpr int kAlign = 128 / cutlass::sizeof_bits<Element>::value;
constexpr int kAlignD = 128 / cutlass::sizeof_bits<ElementOut>::value;
using ProblemShape = Shape<int, int, int, int>;

template <class Tile, class Cluster, class KSched, class ESched>
struct Config {
  using Epi = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassSparseTensorOp, Tile, Cluster,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float,
      void, LayoutD, kAlignD, ElementOut, LayoutD, kAlignD, ESched>::CollectiveOp;
  using Main = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassSparseTensorOp, Element, LayoutA, kAlign, Element, LayoutB,
      kAlign, float, Tile, Cluster,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename Epi::SharedStorage))>,
      KSched>::CollectiveOp;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<ProblemShape, Main, Epi>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
};

// The configuration whose SparseConfig (compressed A and metadata layout) every shipped config shares:
// all tiles have K = 128 (bf16) so min(TileK, 128) and the layout are the same.
using RefConfig = Config<Shape<_128, _128, _128>, Shape<_1, _1, _1>,
                         cutlass::gemm::KernelTmaWarpSpecializedCooperative,
                         cutlass::epilogue::TmaWarpSpecializedCooperative>;
using SparseConfig = typename RefConfig::Main::SparseConfig;
}  // namespace twofour_sm90
