// Tensor-level wrappers: validate, lay out (contiguous views as [L, M, K] blocks or broadcast groups),
// allocate outputs, split the blocks over OpenMP threads and call the kernels of the chosen ISA.
#include "ops.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include "../check.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>

#include "kernel_api.h"

namespace quantlib {
namespace cpu {
namespace generic {
#include "numerics.h"
#include "formats.h"
}  // namespace generic

namespace {

constexpr int64_t kSerialWork = int64_t(1) << 15;  // elements below which one thread does it all
constexpr int64_t kMinSegment = 4096;              // elements of a broadcast segment, at least

std::atomic<const IsaKernels*> g_isa{nullptr};

const IsaKernels& kernels() {
  const IsaKernels* k = g_isa.load(std::memory_order_relaxed);
  return k != nullptr ? *k : *runnable_isas()[0];
}

DType dtype_of(const at::Tensor& x, const char* op) {
  QL_CHECK_VALUE(x.device().is_cpu(), op, ": the cpu backend needs a CPU tensor, got ", x.device());
  switch (x.scalar_type()) {
    case at::kFloat: return DType::F32;
    case at::kBFloat16: return DType::BF16;
    case at::kHalf: return DType::F16;
    default: QL_CHECK_TYPE(false, op, ": input must be float32, bfloat16 or float16, got ", x.scalar_type());
  }
}

// f(begin, end) over [0, n) items, in contiguous chunks over the OpenMP threads (one thread when
// the work is small or we already run inside a parallel region).
template <class F>
void parallel_chunks(int64_t n, int64_t work, const F& f) {
  if (n <= 0) return;
  const int nt = at::in_parallel_region() ? 1 : at::get_num_threads();
  if (nt <= 1 || n == 1 || work < kSerialWork) return f(0, n);
  const int64_t chunks = std::min<int64_t>(n, int64_t(nt) * 4);
#pragma omp parallel for schedule(static) num_threads(nt)
  for (int64_t c = 0; c < chunks; ++c) f(n * c / chunks, n * (c + 1) / chunks);
}

// ---------------------------------------------------------------------------- block layout

struct Layout {
  int64_t L = 1, M = 1, K = 1, BM = 1, BK = 1, mb = 1, kb = 1;
  std::vector<int64_t> blocked;  // shape of the per-block tensors

  int64_t blocks() const { return L * mb * kb; }
};

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

Layout block_layout(const at::Tensor& x, const std::vector<int64_t>& block, const char* op) {
  QL_CHECK_VALUE((block.size() == 1 || block.size() == 2) && std::all_of(block.begin(), block.end(), [](int64_t b) { return b > 0; }),
                    op, ": block must be (B,) or (BM, BK) of positive sizes, got ", at::IntArrayRef(block));
  QL_CHECK_VALUE(x.dim() >= int64_t(block.size()), op, ": a ", block.size(), "-D block needs an input of rank >= ",
                    block.size(), ", got ", x.sizes());
  const auto sizes = x.sizes();
  const int64_t lead_dims = x.dim() - int64_t(block.size());
  Layout g;
  g.K = sizes.back();
  g.BK = block.back();
  g.kb = ceil_div(g.K, g.BK);
  int64_t lead = 1;
  for (int64_t d = 0; d < lead_dims; ++d) lead *= sizes[d];
  if (block.size() == 1) {
    g.M = lead;
    g.mb = g.M;
  } else {
    g.L = lead;
    g.M = sizes[x.dim() - 2];
    g.BM = block[0];
    g.mb = ceil_div(g.M, g.BM);
  }
  g.blocked.assign(sizes.begin(), sizes.begin() + lead_dims);
  if (block.size() == 2) g.blocked.push_back(g.mb);
  g.blocked.push_back(g.kb);
  if (g.BM == 1) {  // (1, BK) blocks are 1-D blocks of all rows (same block order)
    g.M *= g.L;
    g.mb = g.M;
    g.L = 1;
  }
  return g;
}

// Rows of the last dim as blocks (dynamic per-row amax); a 0-d x is one row of one element.
Layout row_layout(const at::Tensor& x) {
  const int64_t K = x.dim() > 0 ? x.size(-1) : 1;
  return block_layout(x.dim() > 0 ? x : x.reshape({1}), {std::max<int64_t>(K, 1)}, "row amax");
}

BlockTask block_task(const at::Tensor& x, DType dt, Op op, Mode mode, const Ctx& ctx, const Layout& g) {
  BlockTask t;
  t.dtype = dt;
  t.op = op;
  t.mode = mode;
  t.ctx = ctx;
  t.x = x.data_ptr();
  t.L = g.L;
  t.M = g.M;
  t.K = g.K;
  t.BM = g.BM;
  t.BK = g.BK;
  t.mb = g.mb;
  t.kb = g.kb;
  return t;
}

void run(const BlockTask& t) {
  if (t.L * t.M * t.K == 0) return;
  const IsaKernels& k = kernels();
  parallel_chunks(t.L * t.mb * t.kb, t.L * t.M * t.K, [&](int64_t b0, int64_t b1) { k.blocks(t, b0, b1); });
}

at::Tensor static_block_amax(const at::Tensor& amax, const Layout& g, const char* op) {
  QL_CHECK_VALUE(amax.sizes() == at::IntArrayRef(g.blocked), op, ": static block amax of shape ", amax.sizes(),
                    " does not fit the input: expected ", at::IntArrayRef(g.blocked));
  return amax.to(at::kFloat).contiguous();
}

// Fake quant of x in blocks; `amax` static (per block) or undefined (computed from each block).
// `s2_rows`: NVFP4's global scale per row (undefined: the ctx's one).
at::Tensor fake_blocks(const at::Tensor& x, DType dt, Op op, const Ctx& ctx, const Layout& g, const at::Tensor& amax,
                       bool nan_groups, const at::Tensor& s2_rows = at::Tensor()) {
  at::Tensor out = at::empty_like(x);
  BlockTask t = block_task(x, dt, op, Mode::FAKE, ctx, g);
  t.out = out.data_ptr();
  if (s2_rows.defined()) t.s2_rows = s2_rows.data_ptr<float>();
  if (amax.defined()) {
    t.amax_in = amax.data_ptr<float>();
    t.nan_groups = nan_groups;
  }
  run(t);
  return out;
}

// ---------------------------------------------------------------------------- broadcast groups

// Fake quant of x whose amax broadcasts against it (per tensor, per channel, any kept axes).
at::Tensor fake_broadcast(const at::Tensor& x, DType dt, Op op, const Ctx& ctx, const at::Tensor& amax) {
  const at::Tensor a = amax.to(at::kFloat).contiguous();
  QL_CHECK_VALUE(a.dim() <= x.dim(), "amax of shape ", a.sizes(), " does not broadcast against the input ", x.sizes());
  const at::Tensor ex = a.expand(x.sizes());  // raises where a does not broadcast
  at::Tensor out = at::empty_like(x);
  if (x.numel() == 0) return out;

  std::vector<float> p0(a.numel()), p1(a.numel());
  const float* ap = a.data_ptr<float>();
  for (int64_t i = 0; i < a.numel(); ++i) {
    const generic::BlockParams p = generic::group_params(op, ctx, ap[i]);
    p0[i] = p.p0;
    p1[i] = p.p1;
  }

  // Coalesce x (contiguous) and the expanded amax strides into as few dims as possible.
  std::vector<int64_t> sz, st;
  for (int64_t d = 0; d < x.dim(); ++d) {
    const int64_t s = x.size(d), stride = ex.stride(d);
    if (s == 1) continue;
    if (!sz.empty() && st.back() == stride * s) {
      sz.back() *= s;
      st.back() = stride;
    } else {
      sz.push_back(s);
      st.push_back(stride);
    }
  }
  if (sz.empty()) {
    sz.push_back(1);
    st.push_back(0);
  }
  const int64_t n = sz.back(), pstride = st.back(), outer = x.numel() / n;
  const int nt = std::max(1, at::get_num_threads());
  const int64_t pieces = std::max<int64_t>(1, std::min(ceil_div(n, kMinSegment), ceil_div(int64_t(nt) * 4, outer)));
  const int64_t seg = ceil_div(n, pieces);

  BcastTask t;
  t.dtype = dt;
  t.op = op;
  t.ctx = ctx;
  t.x = x.data_ptr();
  t.out = out.data_ptr();
  t.p0 = p0.data();
  t.p1 = p1.data();
  const IsaKernels& k = kernels();
  std::atomic<bool> any_nan{false};
  parallel_chunks(outer * pieces, x.numel(), [&](int64_t t0, int64_t t1) {
    bool nan = false;
    for (int64_t task = t0; task < t1; ++task) {
      const int64_t o = task / pieces, j0 = (task % pieces) * seg, len = std::min(seg, n - j0);
      int64_t poff = 0;
      for (int64_t d = int64_t(sz.size()) - 2, rest = o; d >= 0; --d) {
        poff += (rest % sz[d]) * st[d];
        rest /= sz[d];
      }
      nan |= k.segment(t, o * n + j0, len, poff + j0 * pstride, pstride);
    }
    if (nan) any_nan.store(true, std::memory_order_relaxed);
  });
  if (op == Op::INT && any_nan.load()) {
    // formats.int: a NaN anywhere in a group makes that group's scale, hence its output, NaN (rare path).
    const at::Tensor nan_group = at::isnan(x).sum_to_size(a.sizes()).gt(0);
    out.masked_fill_(nan_group, std::nan(""));
  }
  return out;
}

Op fp8_op(const std::vector<int64_t>& element, bool blockwise, const char* name) {
  if (element == std::vector<int64_t>{4, 3}) return blockwise ? Op::FP8BLK_E4M3 : Op::FP8_E4M3;
  if (element == std::vector<int64_t>{5, 2}) return blockwise ? Op::FP8BLK_E5M2 : Op::FP8_E5M2;
  QL_CHECK_VALUE(false, name, ": FP8 element format must be (4, 3) or (5, 2), got ", at::IntArrayRef(element));
}

Op mx_op(const std::string& elem, const char* name) {
  if (elem == "e4m3") return Op::MX_E4M3;
  if (elem == "e2m1") return Op::MX_E2M1;
  if (elem == "e3m2") return Op::MX_E3M2;
  if (elem == "e2m3") return Op::MX_E2M3;
  if (elem == "int8") return Op::MX_INT8;
  QL_CHECK_VALUE(false, name, ": MX element format must be 'e4m3', 'e2m1', 'e3m2', 'e2m3' or 'int8', got '", elem, "'");
}

// NVFP4 global scale s2 from the global amax A (formats.nvfp4.nvfp4_global_scale).
Ctx nvfp4_ctx(float global_amax) {
  Ctx c;
  c.s2 = global_amax <= generic::kTinyAmax ? 1.0f : global_amax / 2688.0f;
  c.six_s2 = 6.0f * c.s2;
  return c;
}

// A global amax of more than one value: one per row, broadcasting to x.shape[:-1] + (1,) ((E, 1, 1) for E
// stacked experts). `s2` has its shape (the cast's global scale); `rows` is s2 expanded, one per row.
struct RowScales {
  at::Tensor s2, rows;
};

RowScales nvfp4_row_scales(const at::Tensor& x, const at::Tensor& global_amax, const char* op) {
  std::vector<int64_t> rows(x.sizes().begin(), x.sizes().end());
  rows.back() = 1;
  const int64_t pad = int64_t(rows.size()) - global_amax.dim();
  bool fits = pad >= 0;
  for (int64_t d = 0; fits && d < global_amax.dim(); ++d) fits = global_amax.size(d) == 1 || global_amax.size(d) == rows[pad + d];
  QL_CHECK_VALUE(fits, op, ": global amax of shape ", global_amax.sizes(), " is neither one value nor one per row of input ",
                    x.sizes(), " (broadcasting to ", at::IntArrayRef(rows), ")");
  const at::Tensor a = global_amax.to(at::kFloat).contiguous();
  RowScales r;
  r.s2 = at::empty(a.sizes(), a.options());
  const float* ap = a.data_ptr<float>();
  float* sp = r.s2.data_ptr<float>();
  for (int64_t i = 0; i < a.numel(); ++i) sp[i] = nvfp4_ctx(ap[i]).s2;
  r.rows = r.s2.expand(rows).contiguous();
  return r;
}

bool per_row(const std::optional<at::Tensor>& global_amax) { return global_amax.has_value() && global_amax->numel() != 1; }

// Global amax of x: static (any shape with one element) or the max of the block amax, which the
// dynamic case computes first into `amax` (the second pass then reads it back).
float nvfp4_global_amax(const at::Tensor& x, DType dt, const Layout& g, const std::optional<at::Tensor>& global_amax,
                        at::Tensor& amax) {
  if (global_amax.has_value()) {
    QL_CHECK_VALUE(global_amax->numel() == 1, "nvfp4: global amax must have one element, got shape ", global_amax->sizes());
    return global_amax->to(at::kFloat).item<float>();
  }
  amax = at::empty(g.blocked, x.options().dtype(at::kFloat));
  BlockTask t = block_task(x, dt, Op::AMAX, Mode::AMAX_ONLY, Ctx{}, g);
  t.amax_out = amax.data_ptr<float>();
  run(t);
  const uint32_t* bits = reinterpret_cast<const uint32_t*>(t.amax_out);
  uint32_t m = 0;  // amax >= 0 or NaN: the largest bits are the max, NaN above Inf
  const int64_t nb = amax.numel();
#pragma omp parallel for reduction(max : m) schedule(static) if (nb > kSerialWork)
  for (int64_t i = 0; i < nb; ++i) m = std::max(m, bits[i]);
  return generic::u2f(m);
}

}  // namespace

// ---------------------------------------------------------------------------- public functions

at::Tensor block_amax(const at::Tensor& x_, const std::vector<int64_t>& block) {
  const at::Tensor x = x_.contiguous();
  const DType dt = dtype_of(x, "block_amax");
  const Layout g = block_layout(x, block, "block_amax");
  at::Tensor amax = at::empty(g.blocked, x.options().dtype(at::kFloat));
  BlockTask t = block_task(x, dt, Op::AMAX, Mode::AMAX_ONLY, Ctx{}, g);
  t.amax_out = amax.data_ptr<float>();
  run(t);
  return amax;
}

at::Tensor fake_quant_int(const at::Tensor& x_, const std::optional<at::Tensor>& amax, const std::vector<int64_t>& block,
                          bool dynamic, int64_t num_bits, bool is_unsigned, bool narrow_range) {
  const at::Tensor x = x_.contiguous();
  const DType dt = dtype_of(x, "fake_quant(int)");
  QL_CHECK_VALUE(num_bits >= 1 && num_bits <= 31, "fake_quant(int): num_bits must be in [1, 31] (int32 codes), got ", num_bits);
  QL_CHECK_VALUE(dynamic || amax.has_value(), "fake_quant(int): a static format needs an amax");
  const double q = is_unsigned ? std::ldexp(1.0, int(num_bits)) - 1.0 : std::ldexp(1.0, int(num_bits) - 1) - 1.0;
  Ctx ctx;
  ctx.hi = float(q);
  ctx.lo = float(is_unsigned ? 0.0 : (narrow_range ? -q : -q - 1.0));
  if (block.empty()) {
    if (!dynamic) return fake_broadcast(x, dt, Op::INT, ctx, *amax);
    return fake_blocks(x, dt, Op::INT, ctx, row_layout(x), at::Tensor(), false);
  }
  const Layout g = block_layout(x, block, "fake_quant(int)");
  const at::Tensor a = dynamic ? at::Tensor() : static_block_amax(*amax, g, "fake_quant(int)");
  return fake_blocks(x, dt, Op::INT, ctx, g, a, true);
}

at::Tensor fake_quant_fp8(const at::Tensor& x_, const std::optional<at::Tensor>& amax, const std::vector<int64_t>& element,
                          bool dynamic) {
  const at::Tensor x = x_.contiguous();
  const DType dt = dtype_of(x, "fake_quant(fp8)");
  const Op op = fp8_op(element, false, "fake_quant(fp8)");
  QL_CHECK_VALUE(dynamic || amax.has_value(), "fake_quant(fp8): a static format needs an amax");
  if (!dynamic) return fake_broadcast(x, dt, op, Ctx{}, *amax);
  return fake_blocks(x, dt, op, Ctx{}, row_layout(x), at::Tensor(), false);
}

at::Tensor fake_quant_fp8_blockwise(const at::Tensor& x_, const std::optional<at::Tensor>& amax,
                                    const std::vector<int64_t>& block, const std::vector<int64_t>& element, double eps,
                                    bool pow2) {
  const at::Tensor x = x_.contiguous();
  const DType dt = dtype_of(x, "fake_quant(fp8_block)");
  const Op op = fp8_op(element, true, "fake_quant(fp8_block)");
  const Layout g = block_layout(x, block, "fake_quant(fp8_block)");
  Ctx ctx;
  ctx.eps = float(eps);
  ctx.pow2 = pow2;
  const at::Tensor a = amax.has_value() ? static_block_amax(*amax, g, "fake_quant(fp8_block)") : at::Tensor();
  return fake_blocks(x, dt, op, ctx, g, a, false);
}

at::Tensor fake_quant_mx(const at::Tensor& x_, const std::string& elem, int64_t block, bool floor_rounding) {
  const at::Tensor x = x_.contiguous();
  const DType dt = dtype_of(x, "fake_quant(mx)");
  const Op op = mx_op(elem, "fake_quant(mx)");
  Ctx ctx;
  ctx.floor = floor_rounding;
  return fake_blocks(x, dt, op, ctx, block_layout(x, {block}, "fake_quant(mx)"), at::Tensor(), false);
}

// Static block amax (NVFP4 with calibrated block scales): it needs the static global amax it was chosen
// against; a block holding NaN still gets NaN outputs (its scale is NaN), as where the amax is computed.
at::Tensor nvfp4_static_blocks(const std::optional<at::Tensor>& global_amax, const std::optional<at::Tensor>& block_amax,
                               const Layout& g, const char* op) {
  if (!block_amax.has_value()) return at::Tensor();
  QL_CHECK_VALUE(global_amax.has_value(), op, ": a static block amax needs the static global amax");
  return static_block_amax(*block_amax, g, op);
}

at::Tensor fake_quant_nvfp4(const at::Tensor& x_, const std::optional<at::Tensor>& global_amax, int64_t block,
                            const std::optional<at::Tensor>& block_amax) {
  const at::Tensor x = x_.contiguous();
  const DType dt = dtype_of(x, "fake_quant(nvfp4)");
  const Layout g = block_layout(x, {block}, "fake_quant(nvfp4)");
  at::Tensor amax = nvfp4_static_blocks(global_amax, block_amax, g, "fake_quant(nvfp4)");
  const bool fixed = amax.defined();
  if (per_row(global_amax)) {
    return fake_blocks(x, dt, Op::NVFP4, Ctx{}, g, amax, fixed, nvfp4_row_scales(x, *global_amax, "fake_quant(nvfp4)").rows);
  }
  const Ctx ctx = nvfp4_ctx(nvfp4_global_amax(x, dt, g, global_amax, amax));
  return fake_blocks(x, dt, Op::NVFP4, ctx, g, amax, fixed);
}

std::tuple<at::Tensor, at::Tensor> fp8_blockwise_cast(const at::Tensor& x_, const std::vector<int64_t>& block, double eps,
                                                      bool pow2, const std::vector<int64_t>& element) {
  const at::Tensor x = x_.contiguous();
  const DType dt = dtype_of(x, "fp8_blockwise_cast");
  const Op op = fp8_op(element, true, "fp8_blockwise_cast");
  const Layout g = block_layout(x, block, "fp8_blockwise_cast");
  at::Tensor codes = at::empty(x.sizes(), x.options().dtype(op == Op::FP8BLK_E4M3 ? at::kFloat8_e4m3fn : at::kFloat8_e5m2));
  at::Tensor scales = at::empty(g.blocked, x.options().dtype(at::kFloat));
  Ctx ctx;
  ctx.eps = float(eps);
  ctx.pow2 = pow2;
  BlockTask t = block_task(x, dt, op, Mode::CODES, ctx, g);
  t.codes = static_cast<uint8_t*>(codes.data_ptr());
  t.scale_out = scales.data_ptr<float>();
  run(t);
  return {codes, scales};
}

at::Tensor fp8_cast(const at::Tensor& x_, const at::Tensor& scale, const std::vector<int64_t>& element) {
  const at::Tensor x = x_.contiguous();
  const DType dt = dtype_of(x, "fp8_cast");
  const Op op = fp8_op(element, false, "fp8_cast");
  const Layout g = row_layout(x);
  const at::Tensor s = scale.to(at::kFloat).contiguous();
  QL_CHECK_VALUE(s.device().is_cpu() && (s.numel() == 1 || s.numel() == g.M), "fp8_cast: scale must be one value or one per row (",
                    g.M, ") on the CPU, got shape ", s.sizes(), " on ", s.device());
  at::Tensor codes = at::empty(x.sizes(), x.options().dtype(op == Op::FP8_E4M3 ? at::kFloat8_e4m3fn : at::kFloat8_e5m2));
  BlockTask t = block_task(x, dt, op, Mode::CODES, Ctx{}, g);
  t.codes = static_cast<uint8_t*>(codes.data_ptr());
  t.scale_in = s.data_ptr<float>();
  t.one_scale = s.numel() == 1;
  run(t);
  return codes;
}

std::tuple<at::Tensor, at::Tensor> mx_cast(const at::Tensor& x_, const std::string& elem, int64_t block, bool floor_rounding) {
  const at::Tensor x = x_.contiguous();
  const DType dt = dtype_of(x, "mx_cast");
  const Op op = mx_op(elem, "mx_cast");
  const Layout g = block_layout(x, {block}, "mx_cast");
  at::Tensor codes;
  if (op == Op::MX_E2M1) {
    QL_CHECK_VALUE(block % 2 == 0, "mx_cast: packed E2M1 needs an even block, got ", block);
    std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
    shape.back() = (shape.back() + 1) / 2;
    codes = at::empty(shape, x.options().dtype(at::kByte));
  } else {  // one code per byte: E4M3 as float8, FP6 as uint8 (sign in bit 5), INT8 as int8
    const at::ScalarType dtype = op == Op::MX_E4M3 ? at::kFloat8_e4m3fn : (op == Op::MX_INT8 ? at::kChar : at::kByte);
    codes = at::empty(x.sizes(), x.options().dtype(dtype));
  }
  at::Tensor bytes = at::empty(g.blocked, x.options().dtype(at::kByte));
  Ctx ctx;
  ctx.floor = floor_rounding;
  BlockTask t = block_task(x, dt, op, Mode::CODES, ctx, g);
  t.codes = static_cast<uint8_t*>(codes.data_ptr());
  t.byte_out = bytes.data_ptr<uint8_t>();
  run(t);
  return {codes, bytes};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> nvfp4_cast(const at::Tensor& x_, const std::optional<at::Tensor>& global_amax,
                                                          int64_t block, const std::optional<at::Tensor>& block_amax) {
  const at::Tensor x = x_.contiguous();
  const DType dt = dtype_of(x, "nvfp4_cast");
  const Layout g = block_layout(x, {block}, "nvfp4_cast");
  QL_CHECK_VALUE(block % 2 == 0, "nvfp4_cast: packed E2M1 needs an even block, got ", block);
  at::Tensor amax = nvfp4_static_blocks(global_amax, block_amax, g, "nvfp4_cast");
  const bool fixed = amax.defined();
  RowScales rs;
  if (per_row(global_amax)) rs = nvfp4_row_scales(x, *global_amax, "nvfp4_cast");
  const Ctx ctx = rs.rows.defined() ? Ctx{} : nvfp4_ctx(nvfp4_global_amax(x, dt, g, global_amax, amax));
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = (shape.back() + 1) / 2;
  at::Tensor packed = at::empty(shape, x.options().dtype(at::kByte));
  at::Tensor scales = at::empty(g.blocked, x.options().dtype(at::kFloat8_e4m3fn));
  BlockTask t = block_task(x, dt, Op::NVFP4, Mode::CODES, ctx, g);
  if (amax.defined()) t.amax_in = amax.data_ptr<float>();
  t.nan_groups = fixed;
  t.codes = packed.data_ptr<uint8_t>();
  t.byte_out = static_cast<uint8_t*>(scales.data_ptr());
  if (rs.rows.defined()) t.s2_rows = rs.rows.data_ptr<float>();
  run(t);
  return {packed, scales, rs.rows.defined() ? rs.s2 : at::full({}, ctx.s2, x.options().dtype(at::kFloat))};
}

std::string isa() { return kernels().name; }

std::vector<std::string> available_isas() {
  std::vector<std::string> names;
  for (const IsaKernels* const* k = runnable_isas(); *k != nullptr; ++k) names.emplace_back((*k)->name);
  return names;
}

void set_isa(const std::string& name) {
  for (const IsaKernels* const* k = runnable_isas(); *k != nullptr; ++k) {
    if (name == (*k)->name) {
      g_isa.store(*k);
      return;
    }
  }
  QL_CHECK_VALUE(false, "set_isa: '", name, "' is not compiled in or not supported by this CPU; available: ",
                    c10::Join(", ", available_isas()));
}

}  // namespace cpu
}  // namespace quantlib
