// Segmented multi-LoRA delta on CPU: y[t] += (x[t] @ A[s]) @ B[s] for every token t of segment (s, start, end).
// An adapter wider than one page (lora_layers.py) is a run of `pages` consecutive pages from s: its A is the
// pages' A side by side (each [in, R], R the page rank), its B the pages' B stacked ([pages x R, out], one
// contiguous block), so the task reads each row of A from every page into one vector and expands once.
//
// Decode: a few tokens per adapter, so each segment's work is two tiny matmuls whose cost is reading A[s] and
// B[s] from memory (16 rank-16 adapters on all linears of a 150M model: ~145 MB per step in fp32, against
// ~7.8 GFLOP of base GEMMs that are compute-bound). Library calls here are dominated by their own overhead
// (oneDNN primitive setup for bf16), so small segments run in plain loops the compiler vectorises: every
// segment is one task that reads A[s] once for all its tokens (shrink), then B[s] once for all its tokens
// (expand) into its own rows of y, so there is one parallel region per call and no barrier between the
// phases. Accumulation is in float; bf16 is widened with a shift the compiler vectorises.
// Prefill: long segments are compute-bound GEMMs: h = x_seg @ A[s] (at::mm), then y_seg += h @ B[s] with the
// accumulate fused into the GEMM (addmm_, beta = 1), so the delta never round-trips through a temporary; in
// chunks of a fixed height (see dense_segment).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <type_traits>
#include <vector>

namespace {

constexpr int64_t kMaxRank = 256;
constexpr int64_t kTokenBlock = 4;     // tokens of one segment computed together (A and B read once per block)
constexpr int64_t kColumnChunk = 256;  // expand: output columns per accumulator chunk
constexpr int64_t kDenseSegment = 32;  // segments at least this long use GEMMs
constexpr int64_t kDenseChunk = 128;   // ... of this many rows each

template <typename T>
inline float to_float(T v) { return static_cast<float>(v); }

// bf16 -> float as a plain shift on the bits, which the compiler vectorises (c10's conversion it does not).
template <>
inline float to_float<at::BFloat16>(at::BFloat16 v) {
  const uint32_t bits = static_cast<uint32_t>(v.x) << 16;
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}

template <typename T>
inline T from_float(float v) { return static_cast<T>(v); }

// float -> bf16 with round-to-nearest-even and NaN kept NaN, as c10 does, but vectorisable.
template <>
inline at::BFloat16 from_float<at::BFloat16>(float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof(bits));
  const uint32_t rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
  const uint16_t out = v != v ? static_cast<uint16_t>(0x7FC0u) : static_cast<uint16_t>(rounded);
  return at::BFloat16(out, at::BFloat16::from_bits());
}

// One segment's rows [start, end): y[t] += (x[t] @ A) @ B, tokens in blocks of kTokenBlock, for a run of `pages`
// pages of `page_rank` each. R > 0 is the run's whole rank known at compile time (the loops over it then compile
// to straight vector code: with a runtime bound of 16, loop control costs more than the one vector op it
// controls); R == 0 reads it as pages x page_rank. Row i of the run's A is its pages' rows i side by side,
// gathered into one vector, so a run costs what one adapter of its rank in one slot would; P > 0 is the page
// rank known at compile time, for the gather's loops.
template <typename T, int64_t R, int64_t P>
void segment_delta(T* yp, const T* xp, const T* as, const T* bs, int64_t start, int64_t end, int64_t in,
                   int64_t runtime_page_rank, int64_t out, int64_t pages) {
  const int64_t page_rank = P > 0 ? P : runtime_page_rank;
  const int64_t rank = R > 0 ? R : pages * page_rank;
  const int64_t page_stride = in * page_rank;  // elements between one page's A and the next's
  alignas(64) float h[kTokenBlock][kMaxRank];
  alignas(64) float acc[kTokenBlock][kColumnChunk];
  for (int64_t t0 = start; t0 < end; t0 += kTokenBlock) {
    const int64_t nt = std::min(kTokenBlock, end - t0);
    // Shrink: h[t] = x[t] @ A, A streamed once for the block; two partial sums per token over i halve the
    // dependency chain of the accumulation.
    alignas(64) float h2[kTokenBlock][kMaxRank];
    for (int64_t t = 0; t < nt; ++t) {
      std::fill(h[t], h[t] + rank, 0.0f);
      std::fill(h2[t], h2[t] + rank, 0.0f);
    }
    alignas(64) float fa0[kMaxRank];
    alignas(64) float fa1[kMaxRank];
    int64_t i = 0;
    for (; i + 1 < in; i += 2) {  // each row of A widened once, then used by every token of the block
      if (pages == 1) {
        const T* a0 = as + i * rank;
#pragma omp simd
        for (int64_t r = 0; r < rank; ++r) {
          fa0[r] = to_float(a0[r]);
          fa1[r] = to_float(a0[rank + r]);
        }
      } else {
        for (int64_t page = 0; page < pages; ++page) {
          const T* a0 = as + page * page_stride + i * page_rank;
          float* f0 = fa0 + page * page_rank;
          float* f1 = fa1 + page * page_rank;
#pragma omp simd
          for (int64_t r = 0; r < page_rank; ++r) {
            f0[r] = to_float(a0[r]);
            f1[r] = to_float(a0[page_rank + r]);
          }
        }
      }
      for (int64_t t = 0; t < nt; ++t) {
        const T* xr = xp + (t0 + t) * in;
        const float x0 = to_float(xr[i]), x1 = to_float(xr[i + 1]);
        float* ht = h[t];
        float* h2t = h2[t];
#pragma omp simd
        for (int64_t r = 0; r < rank; ++r) {
          ht[r] += x0 * fa0[r];
          h2t[r] += x1 * fa1[r];
        }
      }
    }
    for (; i < in; ++i) {
      for (int64_t page = 0; page < pages; ++page) {
        const T* a0 = as + page * page_stride + i * page_rank;
        for (int64_t r = 0; r < page_rank; ++r) fa0[page * page_rank + r] = to_float(a0[r]);
      }
      for (int64_t t = 0; t < nt; ++t) {
        const float x0 = to_float(xp[(t0 + t) * in + i]);
        float* ht = h[t];
#pragma omp simd
        for (int64_t r = 0; r < rank; ++r) ht[r] += x0 * fa0[r];
      }
    }
    for (int64_t t = 0; t < nt; ++t) {
#pragma omp simd
      for (int64_t r = 0; r < rank; ++r) h[t][r] += h2[t][r];
    }
    // Expand: y[t] += h[t] @ B, column chunk by chunk, each row of B read once for the block.
    for (int64_t o = 0; o < out; o += kColumnChunk) {
      const int64_t w = std::min(kColumnChunk, out - o);
      for (int64_t t = 0; t < nt; ++t) {
        const T* yr = yp + (t0 + t) * out + o;
        float* ac = acc[t];
#pragma omp simd
        for (int64_t k = 0; k < w; ++k) ac[k] = to_float(yr[k]);
      }
      alignas(64) float fb[kColumnChunk];
      for (int64_t r = 0; r < rank; ++r) {  // each chunk of a row of B widened once for the block
        const T* br = bs + r * out + o;
#pragma omp simd
        for (int64_t k = 0; k < w; ++k) fb[k] = to_float(br[k]);
        for (int64_t t = 0; t < nt; ++t) {
          const float hv = h[t][r];
          float* ac = acc[t];
#pragma omp simd
          for (int64_t k = 0; k < w; ++k) ac[k] += hv * fb[k];
        }
      }
      for (int64_t t = 0; t < nt; ++t) {
        T* yr = yp + (t0 + t) * out + o;
        const float* ac = acc[t];
#pragma omp simd
        for (int64_t k = 0; k < w; ++k) yr[k] = from_float<T>(ac[k]);
      }
    }
  }
}

template <typename T>
void sgmv_small(const torch::Tensor& y, const torch::Tensor& x, const torch::Tensor& a, const torch::Tensor& b,
                const std::vector<std::array<int64_t, 4>>& segs) {
  if (segs.empty()) return;
  const int64_t in = x.size(1), page_rank = a.size(2), out = b.size(2);
  const T* xp = x.data_ptr<T>();
  const T* ap = a.data_ptr<T>();
  const T* bp = b.data_ptr<T>();
  T* yp = y.data_ptr<T>();
  // One task per segment: its rows of y are its own, so the tasks never meet.
  at::parallel_for(0, static_cast<int64_t>(segs.size()), 1, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      const auto& s = segs[g];
      const T* const as = ap + s[0] * in * page_rank;
      const T* const bs = bp + s[0] * page_rank * out;
      const auto run = [&](auto rank, auto page) {
        segment_delta<T, decltype(rank)::value, decltype(page)::value>(yp, xp, as, bs, s[1], s[2], in, page_rank,
                                                                         out, s[3]);
      };
      const auto with_page = [&](auto rank) {
        switch (page_rank) {  // the page rank: the usual ones get straight-line gathers
          case 8: return run(rank, std::integral_constant<int64_t, 8>{});
          case 16: return run(rank, std::integral_constant<int64_t, 16>{});
          default: return run(rank, std::integral_constant<int64_t, 0>{});
        }
      };
      switch (s[3] * page_rank) {  // the run's rank: the usual ones get straight-line code
        case 8: with_page(std::integral_constant<int64_t, 8>{}); break;
        case 16: with_page(std::integral_constant<int64_t, 16>{}); break;
        case 32: with_page(std::integral_constant<int64_t, 32>{}); break;
        case 64: with_page(std::integral_constant<int64_t, 64>{}); break;
        default: with_page(std::integral_constant<int64_t, 0>{}); break;
      }
    }
  });
}

// A long segment as GEMMs of power-of-two heights >= kDenseChunk rows: oneDNN (bf16, AMX) builds a primitive
// for each new shape, milliseconds each, and prefill segment lengths differ every step, so GEMMs of the
// segment's own height made the delta cost several times its arithmetic. Whole chunks accumulate in place
// (addmm_, beta 1), the segment split as its length's binary digits (384 = 256 + 128: two calls, two shapes);
// the tail runs a full-height window that ends at the segment's end (or starts at row 0) and adds only its
// own rows. Only a step with fewer than kDenseChunk LoRA tokens in all runs one GEMM of another height.
void dense_segment(torch::Tensor& y, const torch::Tensor& x, const torch::Tensor& a, const torch::Tensor& b,
                   int64_t start, int64_t end) {
  const int64_t n = x.size(0);
  if (n < kDenseChunk) {
    y.narrow(0, start, end - start).addmm_(at::mm(x.narrow(0, start, end - start), a), b);
    return;
  }
  int64_t row = start;
  for (int64_t height = int64_t{1} << 62; height >= kDenseChunk; height >>= 1) {  // binary: few calls, few shapes
    if (end - row >= height) {
      y.narrow(0, row, height).addmm_(at::mm(x.narrow(0, row, height), a), b);
      row += height;
    }
  }
  if (row == end) return;
  const int64_t window = std::min(std::max<int64_t>(end - kDenseChunk, 0), n - kDenseChunk);
  const auto delta = at::mm(at::mm(x.narrow(0, window, kDenseChunk), a), b);
  y.narrow(0, row, end - row).add_(delta.narrow(0, row - window, end - row));
}

// A run's A side by side, [in, pages x R] (a copy: its pages are [in, R] blocks), and its B, [pages x R, out] (a
// view: the pages' B are one block), for the GEMM path.
std::pair<torch::Tensor, torch::Tensor> run_matrices(const torch::Tensor& a, const torch::Tensor& b, int64_t slot,
                                                     int64_t pages) {
  if (pages == 1) return {a[slot], b[slot]};
  const auto run_a = a.narrow(0, slot, pages).permute({1, 0, 2}).reshape({a.size(1), pages * a.size(2)});
  return {run_a, b.narrow(0, slot, pages).reshape({pages * b.size(1), b.size(2)})};
}

}  // namespace

// y [T, out] (rows [0, n) updated in place), x [n, in], a [S, in, R], b [S, R, out], segments [G, 3] or [G, 4]
// int64: (slot, start, end[, pages]), pages 1 when absent.
void sgmv(torch::Tensor y, torch::Tensor x, torch::Tensor a, torch::Tensor b, torch::Tensor segments) {
  TORCH_CHECK(x.is_contiguous() && a.is_contiguous() && b.is_contiguous() && y.is_contiguous(), "contiguous inputs");
  TORCH_CHECK(x.scalar_type() == a.scalar_type() && a.scalar_type() == b.scalar_type() &&
              b.scalar_type() == y.scalar_type(), "one dtype for x, A, B and y");
  TORCH_CHECK(a.size(2) <= kMaxRank, "rank above ", kMaxRank);
  TORCH_CHECK(segments.scalar_type() == torch::kInt64 && segments.is_contiguous(), "segments: contiguous int64");
  const int64_t cols = segments.dim() == 2 ? segments.size(1) : 3;
  TORCH_CHECK(segments.size(0) == 0 || cols == 3 || cols == 4, "segments: [G, 3] or [G, 4]");
  const auto* sp = segments.data_ptr<int64_t>();
  std::vector<std::array<int64_t, 4>> small;
  small.reserve(static_cast<size_t>(segments.size(0)));
  for (int64_t g = 0; g < segments.size(0); ++g) {
    const int64_t slot = sp[cols * g], start = sp[cols * g + 1], end = sp[cols * g + 2];
    const int64_t pages = cols == 4 ? sp[cols * g + 3] : 1;
    TORCH_CHECK(pages >= 1 && slot + pages <= a.size(0) && pages * a.size(2) <= kMaxRank, "a run out of range");
    if (end - start >= kDenseSegment) {
      const auto [run_a, run_b] = run_matrices(a, b, slot, pages);
      dense_segment(y, x, run_a, run_b, start, end);
    } else if (end > start) {
      small.push_back({slot, start, end, pages});
    }
  }
  if (x.scalar_type() == torch::kFloat32) {
    sgmv_small<float>(y, x, a, b, small);
  } else if (x.scalar_type() == torch::kBFloat16) {
    sgmv_small<at::BFloat16>(y, x, a, b, small);
  } else if (x.scalar_type() == torch::kHalf) {
    sgmv_small<at::Half>(y, x, a, b, small);
  } else {
    TORCH_CHECK(false, "unsupported dtype ", x.scalar_type());
  }
}

// Without the GIL, as torch's own ops run: the engine loop's delta must not stall the replica's event loop
// (token delivery, new requests, health checks) for its length.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("sgmv", &sgmv, "segmented multi-LoRA delta (CPU)", pybind11::call_guard<pybind11::gil_scoped_release>());
}
