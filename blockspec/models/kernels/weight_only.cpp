// Weight-only int8 and int4 linear layers for x86 CPUs with AVX2, FMA and F16C (built with
// BLOCKSPEC_AVX512 defined and -mavx512f for CPUs that have AVX-512).
//
// Activations and sums stay fp32; only the weights are stored in fewer bytes, in blocks of 32
// along the input dimension with an fp16 scale each: int8 is GGUF's Q8_0 (w = q * d), int4 its
// Q4_1 (w = q * d + m, q in 0..15). Weights are laid out in groups of 64 output features (four
// panels of 16), k-major inside a group: a group is one sequential stream, a cache line a k for
// int8, and one load gives a panel's 16 weights at one k.
//
// Every output is summed the same way, whatever the number of rows or how they are tiled:
//   s_b = sum over the block's k, in order, of x_k * q_k      (one fp32 FMA chain from zero)
//   y   = fma(s_b, d_b, y)  for int8;  y = fma(s_b, d_b, fma(x_b, m_b, y))  for int4
// over blocks b in order from y = 0, where x_b is the row's sum over the block (summed in order).
// So a row's result is the same bit for bit in a verify forward of many tokens and in a
// single-token forward, which speculative decoding needs to stay lossless; and the scale costs
// one FMA a block instead of a multiply a weight.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <vector>

namespace {

constexpr int64_t kPanel = 16;    // output features a panel
constexpr int64_t kBlock = 32;    // input features sharing one scale
constexpr int64_t kGroup = 4;     // panels a group (a task)
constexpr int64_t kRowTile = 6;   // rows a full tile
constexpr int64_t kAhead = 4;     // blocks a prefetch reads ahead

enum Format : int64_t { kInt4 = 4, kInt8 = 8 };

template <Format F>
constexpr int64_t bytes_per_k() { return F == kInt8 ? kPanel : kPanel / 2; }  // a panel's

template <Format F>
constexpr int64_t row_bytes() { return kGroup * bytes_per_k<F>(); }  // a group's, at one k

// The vector the kernel is built for: AVX-512 (one vector a panel) where the CPU has it, else AVX2 (two).
// An output's lane does the same FMAs in the same order in both, so they give the same bits.
#if defined(BLOCKSPEC_AVX512)
using V = __m512;
constexpr int kLanes = 16;
inline V vzero() { return _mm512_setzero_ps(); }
inline V vload(const float* p) { return _mm512_loadu_ps(p); }
inline void vstore(float* p, V v) { _mm512_storeu_ps(p, v); }
inline V vfma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
inline V vbroadcast(const float* p) { return _mm512_set1_ps(*p); }
inline V halves(const at::Half* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
#else
using V = __m256;
constexpr int kLanes = 8;
inline V vzero() { return _mm256_setzero_ps(); }
inline V vload(const float* p) { return _mm256_loadu_ps(p); }
inline void vstore(float* p, V v) { _mm256_storeu_ps(p, v); }
inline V vfma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
inline V vbroadcast(const float* p) { return _mm256_broadcast_ss(p); }
inline V halves(const at::Half* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
#endif
constexpr int kVecs = kPanel / kLanes;  // vectors a panel

// The 16 quantized weights of a panel at one k, as floats (q itself: the scale comes per block).
template <Format F>
inline void weights_at(const uint8_t* row, V* out) {
  const __m128i nibble = _mm_set1_epi8(0x0F);
#if defined(BLOCKSPEC_AVX512)
  if constexpr (F == kInt8) {
    out[0] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row))));
  } else {
    const __m128i v = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(row));
    const __m128i ordered = _mm_unpacklo_epi64(_mm_and_si128(v, nibble), _mm_and_si128(_mm_srli_epi16(v, 4), nibble));
    out[0] = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(ordered));
  }
#else
  if constexpr (F == kInt8) {
    out[0] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(row))));
    out[1] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + 8))));
  } else {
    const __m128i v = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(row));
    out[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_and_si128(v, nibble)));
    out[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(v, 4), nibble)));
  }
#endif
}

// Where a tile reads its weights: straight from the quantized group (few rows), or from a slice the
// group's block was widened into once for many rows. Both give the same floats.
template <Format F>
struct Packed {
  const uint8_t* q;  // the group's [K][4 panels][16 weights]
  int64_t first_panel;
  inline void at(int p, int64_t k, V* out) const {
    weights_at<F>(q + k * row_bytes<F>() + (first_panel + p) * bytes_per_k<F>(), out);
  }
  void shift(int64_t p) { first_panel += p; }
};

struct Widened {
  const float* w;  // [panels][32][16]: one block, from input k0
  int64_t panel_floats, k0;
  inline void at(int p, int64_t k, V* out) const {
    for (int v = 0; v < kVecs; ++v) out[v] = vload(w + p * panel_floats + (k - k0) * kPanel + v * kLanes);
  }
  void shift(int64_t p) { w += p * panel_floats; }
};

// One block (k in [k0, k0 + 32)) of MR rows and NP panels, folded into y as the header says.
// d, m: the block's scales and minimums of the NP panels as floats ([NP * 16]); xs: each row's block sum.
template <Format F, int MR, int NP, class Source>
inline void block(const Source& source, const float* __restrict x, int64_t ldx, int64_t k0, const float* d,
                  const float* m, const float* xs, int64_t xs_stride, float* __restrict y, int64_t ldy, bool first) {
  constexpr int NV = NP * kVecs;
  V acc[MR][NV];
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 8
    for (int j = 0; j < NV; ++j) acc[i][j] = vzero();
  for (int64_t k = k0; k < k0 + kBlock; ++k) {
    V wv[NV];
#pragma GCC unroll 8
    for (int p = 0; p < NP; ++p) source.at(p, k, wv + p * kVecs);
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) {
      const V xv = vbroadcast(x + i * ldx + k);
#pragma GCC unroll 8
      for (int j = 0; j < NV; ++j) acc[i][j] = vfma(xv, wv[j], acc[i][j]);
    }
  }
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i) {
#pragma GCC unroll 8
    for (int j = 0; j < NV; ++j) {
      V total = first ? vzero() : vload(y + i * ldy + kLanes * j);
      if constexpr (F == kInt4) total = vfma(vbroadcast(xs + i * xs_stride), vload(m + kLanes * j), total);
      vstore(y + i * ldy + kLanes * j, vfma(acc[i][j], vload(d + kLanes * j), total));
    }
  }
}

// The scales (and minimums) of block b of a group as floats, [4 * 16] each.
template <Format F>
inline void block_scales(const at::Half* scale, const at::Half* low, int64_t b, float* d, float* m) {
  for (int64_t c = 0; c < kGroup * kPanel; c += kLanes) {
    vstore(d + c, halves(scale + b * kGroup * kPanel + c));
    if constexpr (F == kInt4) vstore(m + c, halves(low + b * kGroup * kPanel + c));
  }
}

// Block b of rows [0, M) against the kGroup panels of a group, in tiles that keep at least eight FMA
// chains in flight. AVX-512: every tile takes the whole group (up to 6 rows x 4 vectors). AVX2: full tiles
// of 6 rows go panel by panel; the rows left over take several panels a tile.
template <Format F, class Source>
void rows_block(const Source& source, const float* x, int64_t M, int64_t ldx, int64_t b, const float* d, const float* m,
                const float* xs, int64_t xs_stride, float* y, int64_t ldy) {
  const int64_t k0 = b * kBlock;
  const bool first = b == 0;
#if defined(BLOCKSPEC_AVX512)
  for (int64_t i = 0; i < M; i += kRowTile) {
    const float* xr = x + i * ldx;
    const float* xsr = xs + i * xs_stride;
    float* yr = y + i * ldy;
    switch (std::min<int64_t>(kRowTile, M - i)) {
      case 1: block<F, 1, 4>(source, xr, ldx, k0, d, m, xsr, xs_stride, yr, ldy, first); break;
      case 2: block<F, 2, 4>(source, xr, ldx, k0, d, m, xsr, xs_stride, yr, ldy, first); break;
      case 3: block<F, 3, 4>(source, xr, ldx, k0, d, m, xsr, xs_stride, yr, ldy, first); break;
      case 4: block<F, 4, 4>(source, xr, ldx, k0, d, m, xsr, xs_stride, yr, ldy, first); break;
      case 5: block<F, 5, 4>(source, xr, ldx, k0, d, m, xsr, xs_stride, yr, ldy, first); break;
      default: block<F, 6, 4>(source, xr, ldx, k0, d, m, xsr, xs_stride, yr, ldy, first); break;
    }
  }
#else
  auto panel = [&](int64_t p) { Source s = source; s.shift(p); return s; };
  int64_t i = 0;
  for (; i + kRowTile <= M; i += kRowTile)
    for (int64_t p = 0; p < kGroup; ++p)
      block<F, kRowTile, 1>(panel(p), x + i * ldx, ldx, k0, d + 16 * p, m + 16 * p, xs + i * xs_stride,
                            xs_stride, y + i * ldy + p * kPanel, ldy, first);
  const int64_t left = M - i;
  if (left == 0) return;
  const float* xr = x + i * ldx;
  const float* xsr = xs + i * xs_stride;
  float* yr = y + i * ldy;
  if (left == 1) {
    block<F, 1, 4>(source, xr, ldx, k0, d, m, xsr, xs_stride, yr, ldy, first);
  } else if (left <= 3) {
    for (int64_t p = 0; p < kGroup; p += 2) {
      if (left == 2) block<F, 2, 2>(panel(p), xr, ldx, k0, d + 16 * p, m + 16 * p, xsr, xs_stride, yr + p * kPanel, ldy, first);
      else block<F, 3, 2>(panel(p), xr, ldx, k0, d + 16 * p, m + 16 * p, xsr, xs_stride, yr + p * kPanel, ldy, first);
    }
  } else {
    for (int64_t p = 0; p < kGroup; ++p) {
      if (left == 4) block<F, 4, 1>(panel(p), xr, ldx, k0, d + 16 * p, m + 16 * p, xsr, xs_stride, yr + p * kPanel, ldy, first);
      else block<F, 5, 1>(panel(p), xr, ldx, k0, d + 16 * p, m + 16 * p, xsr, xs_stride, yr + p * kPanel, ldy, first);
    }
  }
#endif
}

// Group g (output features [64 g, 64 g + 64)) for every row. One tile of rows reads the quantized group
// directly, a block at a time, prefetching ahead (a decoding forward streams each weight once, from far
// caches); more rows widen each block of the group once into a slice they all read.
template <Format F>
void group_task(const float* x, int64_t M, int64_t K, const uint8_t* q, const at::Half* scale, const at::Half* low,
                const float* xs, int64_t g, float* y, int64_t ldy) {
  const int64_t blocks = K / kBlock, group_scales = blocks * kGroup * kPanel;
  const uint8_t* qg = q + g * K * row_bytes<F>();
  const at::Half* sg = scale + g * group_scales;
  const at::Half* lg = F == kInt4 ? low + g * group_scales : nullptr;
  alignas(32) float d[kGroup * kPanel], m[kGroup * kPanel];
  alignas(64) float slice[kGroup * kBlock * kPanel];
  float* yg = y + g * kGroup * kPanel;
  for (int64_t b = 0; b < blocks; ++b) {
    block_scales<F>(sg, lg, b, d, m);
    if (M <= kRowTile) {
      const uint8_t* ahead = qg + (b + kAhead) * kBlock * row_bytes<F>();
      for (int64_t line = 0; line < kBlock * row_bytes<F>(); line += 64)
        _mm_prefetch(reinterpret_cast<const char*>(ahead + line), _MM_HINT_T0);
      rows_block<F>(Packed<F>{qg, 0}, x, M, K, b, d, m, xs ? xs + b : nullptr, blocks, yg, ldy);
    } else {
      const Packed<F> packed{qg, 0};
      for (int64_t p = 0; p < kGroup; ++p)
        for (int64_t k = 0; k < kBlock; ++k) {
          V widened[kVecs];
          packed.at(p, b * kBlock + k, widened);
          for (int v = 0; v < kVecs; ++v) vstore(slice + (p * kBlock + k) * kPanel + v * kLanes, widened[v]);
        }
      rows_block<F>(Widened{slice, kBlock * kPanel, b * kBlock}, x, M, K, b, d, m, xs ? xs + b : nullptr, blocks,
                    yg, ldy);
    }
  }
}

// Each row's sum over each block of 32 inputs, in order (int4's minimums multiply it).
std::vector<float> block_sums(const float* x, int64_t M, int64_t K) {
  std::vector<float> sums(M * (K / kBlock));
  for (int64_t i = 0; i < M; ++i)
    for (int64_t b = 0; b < K / kBlock; ++b) {
      float s = 0.0f;
      for (int64_t k = 0; k < kBlock; ++k) s += x[i * K + b * kBlock + k];
      sums[i * (K / kBlock) + b] = s;
    }
  return sums;
}

// x [..., K] fp32; q: [groups, K, 64] int8 or [groups, K, 32] uint8 (int4: panel p's byte c holds its output c
// in the low nibble and output c + 8 in the high one); scale, low: [groups, K / 32, 64] fp16 (low empty for int8).
// Returns x @ w.T as [..., out_features].
at::Tensor weight_only_linear(const at::Tensor& x_in, const at::Tensor& q, const at::Tensor& scale,
                              const at::Tensor& low, int64_t bits, int64_t out_features) {
  TORCH_CHECK(x_in.scalar_type() == at::kFloat, "weight_only_linear takes fp32 activations, got ", x_in.scalar_type());
  TORCH_CHECK(bits == kInt8 || bits == kInt4, "weight_only_linear: bits must be 8 or 4, got ", bits);
  TORCH_CHECK(q.is_contiguous() && scale.is_contiguous() && low.is_contiguous(),
              "weight_only_linear: the packed tensors must be contiguous");
  const int64_t groups = q.size(0), K = q.size(1);
  TORCH_CHECK(x_in.size(-1) == K, "weight_only_linear: x has ", x_in.size(-1), " input features, the weight ", K);
  TORCH_CHECK(K % kBlock == 0, "weight_only_linear: input features must be a multiple of 32, got ", K);
  const at::Tensor x = x_in.contiguous();
  const int64_t M = x.numel() / K, padded = groups * kGroup * kPanel;
  std::vector<int64_t> sizes = x.sizes().vec();
  sizes.back() = padded;
  at::Tensor y = at::empty(sizes, x.options());
  if (M > 0) {
    const float* xp = x.data_ptr<float>();
    const uint8_t* qp = static_cast<const uint8_t*>(q.data_ptr());
    const at::Half* sp = scale.data_ptr<at::Half>();
    const at::Half* lp = bits == kInt4 ? low.data_ptr<at::Half>() : nullptr;
    float* yp = y.data_ptr<float>();
    const std::vector<float> sums = bits == kInt4 ? block_sums(xp, M, K) : std::vector<float>();
    const float* xs = bits == kInt4 ? sums.data() : nullptr;
    at::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
      for (int64_t g = begin; g < end; ++g) {
        if (bits == kInt8) group_task<kInt8>(xp, M, K, qp, sp, lp, xs, g, yp, padded);
        else group_task<kInt4>(xp, M, K, qp, sp, lp, xs, g, yp, padded);
      }
    });
  }
  if (padded == out_features) return y;
  return y.narrow(-1, 0, out_features).contiguous();
}

}  // namespace

TORCH_LIBRARY(blockspec_kernels, m) {
  m.def("weight_only_linear(Tensor x, Tensor q, Tensor scale, Tensor low, int bits, int out_features) -> Tensor");
}

TORCH_LIBRARY_IMPL(blockspec_kernels, CPU, m) { m.impl("weight_only_linear", weight_only_linear); }
