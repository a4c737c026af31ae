// 4-bit HQQ substitutes on x86 CPUs with AVX512-BF16: y = x @ ((q - z) * s).T per group of the
// input dim, without dequantizing the weight to memory. Built on first use by
// vllm_subspec/draft_model/int4_dot_cpu.py (torch's cpp_extension), which also packs the weights.
//
// Layout (made by int4_dot_cpu.pack): the output features in tiles of 16; per tile, blocks of 8
// input features: 64 bytes. Byte 16c + 8h + l (c < 4, h < 2, l < 8) stands for output j = 4c + l/2
// and input e = l % 2 of a pair: its low nibble is q[16t+j, 8b+2h+e], its high one
// q[16t+j, 8b+4+2h+e]. vpunpck{l,h}bw of the nibbles with the byte 0x43 makes each code q the
// bf16 0x43qq = 128 + q, exactly, in 16-bit lane 8c + l of one of four vectors, whose lanes
// (2j, 2j+1) are output j's pair of inputs: one vdpbf16ps against that pair of x broadcast to
// every lane adds both products into output j's fp32 lane. Per group, with A = sum((128 + q) x)
// (fp32 sums of exact products), y += s * (A - 136 * sum(x)) + ((8 - z) * s) * sum(x), that is
// s * sum((q - 8) * x) + (8 - z) * s * sum(x); s and (8 - z) * s come from `meta` ([T, G, 32]
// bf16: 16 scales, then 16 offsets), the numbers tinygemm stores (an HQQ zero is near 8, so the
// offset is small and rounds to bf16 with a small error). The rows of x share each unpacked
// vector (up to 8 rows per pass over a tile), so a tree level of k rows costs far less than k
// single rows.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/extension.h>
#include <immintrin.h>

#include <algorithm>
#include <cstring>

namespace {

inline __m512 bf16_to_fp32(__m256i v) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}

inline __m512bh pair_of(const at::BFloat16* p) {  // x[k], x[k+1] in every 32-bit lane
  int32_t v;
  std::memcpy(&v, p, sizeof v);
  return (__m512bh)_mm512_set1_epi32(v);
}

// One tile (16 outputs) for MB rows. NA accumulators per row: 4 independent vdpbf16ps chains
// for one or two rows (the instruction's latency would bound a single chain), 2 beyond.
template <int MB, int NA>
void tile_rows(const uint8_t* __restrict w, const at::BFloat16* __restrict meta,
               const at::BFloat16* __restrict x, int64_t ldx, const float* __restrict xs,
               int64_t G, int64_t gs, at::BFloat16* __restrict y, int64_t ldy) {
  const __m512i nib = _mm512_set1_epi8(0x0F);
  const __m512i bias = _mm512_set1_epi8(0x43);
  __m512 out[MB];
  for (int m = 0; m < MB; ++m) out[m] = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    __m512 acc[MB][NA];
    for (int m = 0; m < MB; ++m)
      for (int a = 0; a < NA; ++a) acc[m][a] = _mm512_setzero_ps();
    const uint8_t* wg = w + g * gs * 8;  // gs/8 blocks of 64 bytes
    for (int64_t b = 0; b < gs / 8; ++b) {
      const __m512i v = _mm512_loadu_si512(wg + b * 64);
      const __m512i lo = _mm512_and_si512(v, nib);
      const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), nib);
      // a nibble q as the low byte under 0x43: the bf16 of 128 + q, exactly
      const __m512bh w0 = (__m512bh)_mm512_unpacklo_epi8(lo, bias);
      const __m512bh w1 = (__m512bh)_mm512_unpackhi_epi8(lo, bias);
      const __m512bh w2 = (__m512bh)_mm512_unpacklo_epi8(hi, bias);
      const __m512bh w3 = (__m512bh)_mm512_unpackhi_epi8(hi, bias);
      for (int m = 0; m < MB; ++m) {
        const at::BFloat16* xp = x + m * ldx + g * gs + b * 8;  // inputs 8b .. 8b+7
        acc[m][0] = _mm512_dpbf16_ps(acc[m][0], w0, pair_of(xp));
        acc[m][1 % NA] = _mm512_dpbf16_ps(acc[m][1 % NA], w1, pair_of(xp + 2));
        acc[m][2 % NA] = _mm512_dpbf16_ps(acc[m][2 % NA], w2, pair_of(xp + 4));
        acc[m][3 % NA] = _mm512_dpbf16_ps(acc[m][3 % NA], w3, pair_of(xp + 6));
      }
    }
    const __m512i sz = _mm512_loadu_si512(meta + g * 32);
    const __m512 s = bf16_to_fp32(_mm512_castsi512_si256(sz));
    const __m512 zt = bf16_to_fp32(_mm512_extracti64x4_epi64(sz, 1));
    for (int m = 0; m < MB; ++m) {
      __m512 sum = acc[m][0];
      for (int a = 1; a < NA; ++a) sum = _mm512_add_ps(sum, acc[m][a]);
      const __m512 xsum = _mm512_set1_ps(xs[m * G + g]);
      sum = _mm512_fnmadd_ps(_mm512_set1_ps(136.0f), xsum, sum);  // sum((q - 8) * x)
      out[m] = _mm512_fmadd_ps(sum, s, out[m]);
      out[m] = _mm512_fmadd_ps(zt, xsum, out[m]);
    }
  }
  for (int m = 0; m < MB; ++m)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + m * ldy), (__m256i)_mm512_cvtneps_pbh(out[m]));
}

using TileFn = void (*)(const uint8_t*, const at::BFloat16*, const at::BFloat16*, int64_t,
                        const float*, int64_t, int64_t, at::BFloat16*, int64_t);
constexpr int kMaxRows = 8;  // rows sharing one pass over a tile
const TileFn kTile[kMaxRows + 1] = {nullptr,          tile_rows<1, 4>, tile_rows<2, 4>,
                                    tile_rows<3, 2>,  tile_rows<4, 2>, tile_rows<5, 2>,
                                    tile_rows<6, 2>,  tile_rows<7, 2>, tile_rows<8, 2>};

}  // namespace

// x [M, K] bf16 (contiguous), packed [N/16, K/8, 64] uint8, meta [N/16, K/gs, 32] bf16
// -> y [M, N] bf16.
at::Tensor int4_dot_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& meta,
                           int64_t gs) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.is_contiguous(),
              "x: contiguous [M, K] bf16");
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == at::kByte && packed.is_contiguous());
  TORCH_CHECK(meta.dim() == 3 && meta.scalar_type() == at::kBFloat16 && meta.is_contiguous());
  TORCH_CHECK(gs > 0 && gs % 8 == 0, "int4_dot_linear: group size ", gs);
  const int64_t M = x.size(0), K = x.size(1), T = packed.size(0), G = K / gs;
  TORCH_CHECK(K % gs == 0 && packed.size(1) * 8 == K && packed.size(2) == 64 &&
              meta.size(0) == T && meta.size(1) == G && meta.size(2) == 32, "int4_dot_linear: shapes");
  at::Tensor y = at::empty({M, T * 16}, x.options());
  if (M == 0) return y;
  // Each row's sum of x per group: the zero point's term.
  const at::Tensor xs = x.view({M, G, gs}).sum(-1, false, at::kFloat).contiguous();
  const at::BFloat16* xp = x.data_ptr<at::BFloat16>();
  const float* xsp = xs.data_ptr<float>();
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  const at::BFloat16* mp = meta.data_ptr<at::BFloat16>();
  at::BFloat16* yp = y.data_ptr<at::BFloat16>();
  const int64_t blocks = (M + kMaxRows - 1) / kMaxRows;  // rows split evenly: 12 -> 6 + 6
  at::parallel_for(0, T, 16, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      for (int64_t i = 0, m0 = 0; i < blocks; ++i) {
        const int64_t m1 = M * (i + 1) / blocks;
        kTile[m1 - m0](wp + t * K * 8, mp + t * G * 32, xp + m0 * K, K, xsp + m0 * G, G, gs,
                       yp + m0 * T * 16 + t * 16, T * 16);
        m0 = m1;
      }
    }
  });
  return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // No Python object is touched once the arguments are converted: other Python threads of
  // the process (vLLM's I/O threads) run while it computes, as around torch's own ops.
  m.def("int4_dot_linear", &int4_dot_linear, py::call_guard<py::gil_scoped_release>(),
        "x @ W.T for 4-bit HQQ weights (AVX512-BF16)");
}
