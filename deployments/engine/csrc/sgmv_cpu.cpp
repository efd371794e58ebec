// Segmented multi-LoRA delta on CPU: y[t] += (x[t] @ A[s]) @ B[s] for every token t of segment (s, start, end).
//
// Decode batches hold a few tokens per adapter, so the work is many tiny matmuls whose library call overhead
// (and, for bf16, oneDNN primitive setup) dwarfs their arithmetic. Here each segment's rows are computed in
// plain loops that the compiler vectorises over the rank (shrink) and over output columns (expand), with
// float accumulation; weights are read once per segment, which keeps the cost near the memory traffic floor.
// Segments with many tokens (prefill) are compute-bound and go to at::matmul instead.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>
#include <array>
#include <vector>

namespace {

constexpr int64_t kMaxRank = 256;
constexpr int64_t kColumnChunk = 256;
constexpr int64_t kDenseSegment = 32;  // segments at least this long use at::matmul

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
void sgmv_small(const torch::Tensor& y, const torch::Tensor& x, const torch::Tensor& a, const torch::Tensor& b,
                const std::vector<std::array<int64_t, 3>>& segs) {
  const int64_t in = x.size(1), rank = a.size(2), out = b.size(2);
  if (segs.empty()) return;
  int64_t rows = 0;
  for (const auto& s : segs) rows += s[2] - s[1];
  std::vector<float> h(static_cast<size_t>(rows * rank));
  std::vector<int64_t> h_row(segs.size());  // first row of each segment in h
  for (size_t g = 0, r = 0; g < segs.size(); r += segs[g][2] - segs[g][1], ++g) h_row[g] = static_cast<int64_t>(r);

  const T* xp = x.data_ptr<T>();
  const T* ap = a.data_ptr<T>();
  const T* bp = b.data_ptr<T>();
  T* yp = y.data_ptr<T>();

  // Shrink: h = x @ A[s], one segment per task.
  at::parallel_for(0, static_cast<int64_t>(segs.size()), 1, [&](int64_t g0, int64_t g1) {
    float acc[kMaxRank];
    for (int64_t g = g0; g < g1; ++g) {
      const auto& s = segs[g];
      const T* as = ap + s[0] * in * rank;
      for (int64_t t = s[1]; t < s[2]; ++t) {
        std::fill(acc, acc + rank, 0.0f);
        const T* xr = xp + t * in;
        for (int64_t i = 0; i < in; ++i) {
          const float xv = to_float(xr[i]);
          const T* ar = as + i * rank;
          for (int64_t r = 0; r < rank; ++r) acc[r] += xv * to_float(ar[r]);
        }
        std::copy(acc, acc + rank, h.data() + (h_row[g] + t - s[1]) * rank);
      }
    }
  });

  // Expand: y += h @ B[s], split over output columns so each thread streams its own slice of every B.
  at::parallel_for(0, out, kColumnChunk, [&](int64_t o0, int64_t o1) {
    float acc[kColumnChunk];
    for (size_t g = 0; g < segs.size(); ++g) {
      const auto& s = segs[g];
      const T* bs = bp + s[0] * rank * out;
      for (int64_t t = s[1]; t < s[2]; ++t) {
        const float* hr = h.data() + (h_row[g] + t - s[1]) * rank;
        T* yr = yp + t * out;
        for (int64_t o = o0; o < o1; o += kColumnChunk) {
          const int64_t w = std::min(kColumnChunk, o1 - o);
          for (int64_t k = 0; k < w; ++k) acc[k] = to_float(yr[o + k]);
          for (int64_t r = 0; r < rank; ++r) {
            const float hv = hr[r];
            const T* br = bs + r * out + o;
            for (int64_t k = 0; k < w; ++k) acc[k] += hv * to_float(br[k]);
          }
          for (int64_t k = 0; k < w; ++k) yr[o + k] = static_cast<T>(acc[k]);
        }
      }
    }
  });
}

}  // namespace

// y [T, out] (rows [0, n) updated in place), x [n, in], a [S, in, R], b [S, R, out], segments [G, 3] int64.
void sgmv(torch::Tensor y, torch::Tensor x, torch::Tensor a, torch::Tensor b, torch::Tensor segments) {
  TORCH_CHECK(x.is_contiguous() && a.is_contiguous() && b.is_contiguous() && y.is_contiguous(), "contiguous inputs");
  TORCH_CHECK(x.scalar_type() == a.scalar_type() && a.scalar_type() == b.scalar_type() &&
              b.scalar_type() == y.scalar_type(), "one dtype for x, A, B and y");
  TORCH_CHECK(a.size(2) <= kMaxRank, "rank above ", kMaxRank);
  const auto* sp = segments.data_ptr<int64_t>();
  std::vector<std::array<int64_t, 3>> small;
  for (int64_t g = 0; g < segments.size(0); ++g) {
    const int64_t slot = sp[3 * g], start = sp[3 * g + 1], end = sp[3 * g + 2];
    if (end - start >= kDenseSegment) {
      auto rows = y.narrow(0, start, end - start);
      rows.add_(at::matmul(at::matmul(x.narrow(0, start, end - start), a[slot]), b[slot]));
    } else {
      small.push_back({slot, start, end});
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

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("sgmv", &sgmv, "segmented multi-LoRA delta (CPU)"); }
