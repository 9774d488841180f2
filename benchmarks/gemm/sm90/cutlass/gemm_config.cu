// One sm90 2:4 GEMM configuration, chosen by -D flags at compile time (the builder compiles this
// file once per configuration and links the objects into one shared library):
// TWOFOUR_NAME, TWOFOUR_TM/TN/TK (tile), TWOFOUR_CM/CN (cluster), TWOFOUR_PINGPONG (else cooperative).
#include "sm90_sparse.cuh"

namespace twofour_sm90 {
#ifdef TWOFOUR_PINGPONG
using KS = cutlass::gemm::KernelTmaWarpSpecializedPingpong;
using ES = cutlass::epilogue::TmaWarpSpecialized;
#else
using KS = cutlass::gemm::KernelTmaWarpSpecializedCooperative;
using ES = cutlass::epilogue::TmaWarpSpecializedCooperative;
#endif
using Cfg = Config<Shape<Int<TWOFOUR_TM>, Int<TWOFOUR_TN>, Int<TWOFOUR_TK>>,
                   Shape<Int<TWOFOUR_CM>, Int<TWOFOUR_CN>, _1>, KS, ES>;
using Gemm = typename Cfg::Gemm;
static_assert(std::is_same_v<typename Cfg::Main::SparseConfig, SparseConfig>,
              "a shipped configuration must read the shared compressed layout");

static typename Gemm::Arguments make_args(const void* a, const void* e, const void* b, void* d, int m, int n,
                                          int k, int sm_count) {
  ProblemShape shape{m, n, k, 1};
  auto layout_a = SparseConfig::fill_layoutA(shape);
  auto layout_e = SparseConfig::fill_layoutE(shape);
  using StrideB = typename Gemm::GemmKernel::StrideB;
  using StrideD = typename Gemm::GemmKernel::StrideD;
  auto stride_b = cutlass::make_cute_packed_stride(StrideB{}, cute::make_shape(n, k, 1));
  auto stride_d = cutlass::make_cute_packed_stride(StrideD{}, cute::make_shape(m, n, 1));
  typename Gemm::Arguments args{
      cutlass::gemm::GemmUniversalMode::kGemm,
      shape,
      {static_cast<const Element*>(a), layout_a, static_cast<const Element*>(b), stride_b,
       static_cast<const typename Cfg::Main::ElementE*>(e), layout_e},
      {{1.0f, 0.0f}, nullptr, stride_d, static_cast<ElementOut*>(d), stride_d}};
  args.hw_info.device_id = 0;
  args.hw_info.sm_count = sm_count;
  return args;
}
}  // namespace twofour_sm90

#define TF_CAT2(a, b) a##b
#define TF_CAT(a, b) TF_CAT2(a, b)

// Workspace bytes this configuration needs at (m, n, k); -1 if it cannot run the shape.
extern "C" long long TF_CAT(twofour_sm90_workspace_, TWOFOUR_NAME)(int m, int n, int k, int sm_count) {
  using namespace twofour_sm90;
  auto args = make_args(nullptr, nullptr, nullptr, nullptr, m, n, k, sm_count);
  if (Gemm::can_implement(args) != cutlass::Status::kSuccess) return -1;
  return static_cast<long long>(Gemm::get_workspace_size(args));
}

// D = A @ B on `stream`; 0 on success, else a cutlass::Status (>0) or 1000 + cudaError.
extern "C" int TF_CAT(twofour_sm90_gemm_, TWOFOUR_NAME)(const void* a, const void* e, const void* b, void* d, int m,
                                                        int n, int k, int sm_count, void* workspace,
                                                        cudaStream_t stream) {
  using namespace twofour_sm90;
  auto args = make_args(a, e, b, d, m, n, k, sm_count);
  Gemm gemm;
  cutlass::Status s = gemm.initialize(args, workspace, stream);
  if (s != cutlass::Status::kSuccess) return static_cast<int>(s) + 1;
  s = gemm.run(stream);
  if (s != cutlass::Status::kSuccess) return static_cast<int>(s) + 1;
  cudaError_t err = cudaGetLastError();
  return err == cudaSuccess ? 0 : 1000 + static_cast<int>(err);
}
