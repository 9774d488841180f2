// The parts of the sm90 2:4 library every configuration shares: the compressed sizes, CUTLASS's
// own compressor (the reference for twofour's compression into this layout) and a host-side probe
// of the metadata layout (so the layout logic in Python is checked against cute's on any machine).
#include "sm90_sparse.cuh"
#include "cutlass/transform/device/transform_universal_adapter.hpp"
#include "cutlass/transform/kernel/sparse_gemm_compressor.hpp"

namespace twofour_sm90 {
using Utility = cutlass::transform::kernel::StructuredSparseCompressorUtility<ProblemShape, Element, LayoutA,
                                                                               SparseConfig>;
using CompressorKernel = cutlass::transform::kernel::StructuredSparseCompressor<ProblemShape, Element, LayoutA,
                                                                                SparseConfig, cutlass::arch::Sm90>;
using Compressor = cutlass::transform::device::TransformUniversalAdapter<CompressorKernel>;
using StrideA = cutlass::gemm::TagToStrideA_t<LayoutA>;

static Utility utility(int m, int k) {
  ProblemShape shape{m, 1, k, 1};
  return Utility(shape, cutlass::make_cute_packed_stride(StrideA{}, cute::make_shape(m, k, 1)));
}
}  // namespace twofour_sm90

// Make `device` current for this library's own (static) CUDA runtime, whose current device is
// separate from torch's: the launches that follow run there. Returns a cudaError.
extern "C" int twofour_sm90_set_device(int device) { return static_cast<int>(cudaSetDevice(device)); }

// Sizes of the compressed operand: values (elements, rows x cols) and metadata (bytes).
extern "C" int twofour_sm90_sizes(int m, int k, long long* a_rows, long long* a_cols, long long* e_bytes) {
  auto u = twofour_sm90::utility(m, k);
  *a_rows = u.get_tensorA_m_physical();
  *a_cols = u.get_tensorA_k_physical();
  *e_bytes = static_cast<long long>(u.get_metadata_m_physical()) * u.get_metadata_k_physical();
  return 0;
}

// The byte offset in E of the metadata of logical element (row, col) of A, for every row < m and
// col < k with col % 8 == 0 (one byte holds the 4-bit metadata of two groups of 4): out[row * k/8 + col/8].
extern "C" int twofour_sm90_layout_e(int m, int k, long long* out) {
  using namespace twofour_sm90;
  ProblemShape shape{m, 1, k, 1};
  auto layout_e = SparseConfig::fill_layoutE(shape);
  constexpr int per_byte = decltype(SparseConfig::ElementEMmaSparsity{})::value;
  if (per_byte != 8) return -per_byte;
  for (int r = 0; r < m; ++r)
    for (int c = 0; c < k; c += 8)
      out[static_cast<long long>(r) * (k / 8) + c / 8] = static_cast<long long>(layout_e(r, c, 0)) / per_byte;
  return 0;
}

// CUTLASS's compressor: A (m x k, row-major, 2:4 in each group of 4 along k) -> values + metadata.
extern "C" int twofour_sm90_compress(const void* a, void* a_comp, void* e, int m, int k, int sm_count,
                                     void* workspace, cudaStream_t stream) {
  using namespace twofour_sm90;
  ProblemShape shape{m, 1, k, 1};
  auto stride_a = cutlass::make_cute_packed_stride(StrideA{}, cute::make_shape(m, k, 1));
  cutlass::KernelHardwareInfo hw;
  hw.device_id = 0;
  hw.sm_count = sm_count;
  typename Compressor::Arguments args{shape,
                                      {static_cast<const Element*>(a), stride_a, static_cast<Element*>(a_comp),
                                       static_cast<typename SparseConfig::ElementEMmaRaw*>(e)},
                                      {hw}};
  Compressor op;
  if (op.can_implement(args) != cutlass::Status::kSuccess) return 1;
  if (op.initialize(args, workspace, stream) != cutlass::Status::kSuccess) return 2;
  if (op.run(stream) != cutlass::Status::kSuccess) return 3;
  cudaError_t err = cudaGetLastError();
  return err == cudaSuccess ? 0 : 1000 + static_cast<int>(err);
}

extern "C" long long twofour_sm90_compress_workspace(int m, int k) {
  using namespace twofour_sm90;
  ProblemShape shape{m, 1, k, 1};
  auto stride_a = cutlass::make_cute_packed_stride(StrideA{}, cute::make_shape(m, k, 1));
  typename Compressor::Arguments args{shape, {nullptr, stride_a, nullptr, nullptr}, {}};
  return static_cast<long long>(Compressor::get_workspace_size(args));
}
