// x @ dequantize(w).T on the CPU, reading the packed codes as they are stored.
//
// A decode step reads every weight once per token, so it runs at the speed the codes can be
// streamed from memory: each group's codes are widened to floats in registers (never
// written out), multiplied with x, and scaled once per group:
//     sum_i (s * q_i + b) * x_i  =  s * sum_i q_i * x_i  +  b * sum_i x_i
// with sum_i x_i computed once per call. Where the CPU has AVX-512 VBMI and VNNI, the codes
// are widened to int16 instead and meet x rounded to int16 (see dot_row_wide). Up to 4 rows
// of x share each widened group; more rows take 4 at a time. From gemm_rows() rows on (a prefill chunk), the BLAS's GEMM wins:
// tiles of the weights are dequantized into a scratch buffer and handed to cblas_sgemm.
#include "affine_matmul.h"

#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include "mlx/backend/cpu/encoder.h"
#include "thread_pool.h"

extern "C" void cblas_sgemm(
    int layout, int transa, int transb, int m, int n, int k, float alpha, const float* a,
    int lda, const float* b, int ldb, float beta, float* c, int ldc);

namespace tandem_kernels {

namespace {

constexpr int ROW_MAJOR = 101, NO_TRANS = 111, TRANS = 112;  // CBLAS enum values
constexpr int ROWS_PER_REGISTER_BLOCK = 4;
constexpr size_t TILE_FLOATS = 1 << 20;  // a dequantized weight tile for the GEMM: 4 MiB
constexpr int64_t WORK_PER_CHUNK = 1 << 16;  // weights x rows a pool chunk should carry
int gemm_rows_ = 32;

struct Problem {
  const float* x;  // (M, K)
  const uint8_t* w;  // (N, row_bytes)
  const void* scales;  // (N, groups)
  const void* biases;
  const float* x_sums;  // (M, groups)
  const int16_t* x_codes;  // (M, K): x rounded to int16 per group, for the AVX-512 path (round_x)
  const float* x_steps;  // (M, groups): the value of one of x_codes' steps in each group
  const float* x_lost;  // (M, groups): what rounding x to x_codes lost of each group's sum
  float* y;  // (M, N)
  int M, N, K, group_size, groups;
  int64_t row_bytes;
};

template <typename S>
inline float to_float(S value);
template <>
inline float to_float<float>(float value) {
  return value;
}
template <>
inline float to_float<uint16_t>(uint16_t value) {  // float16
  return _cvtsh_ss(value);
}
struct BFloat16 {
  uint16_t bits;
};
template <>
inline float to_float<BFloat16>(BFloat16 value) {
  uint32_t widened = static_cast<uint32_t>(value.bits) << 16;
  float out;
  std::memcpy(&out, &widened, sizeof(out));
  return out;
}

// The pshufb control and shifts that put code j (of 8 packed LSB first in BITS bytes) into
// 32-bit lane j: its two bytes at the bottom of the lane, then shifted down to bit 0.
template <int BITS>
struct Unpacker {
  __m256i control, shifts, mask;
  Unpacker() {
    alignas(32) int8_t bytes[32];
    alignas(32) int32_t shift[8];
    for (int j = 0; j < 8; j++) {
      int bit = BITS * j;
      int lane_byte = (j % 4) * 4 + (j / 4) * 16;
      bytes[lane_byte] = static_cast<int8_t>(bit / 8);
      bytes[lane_byte + 1] = static_cast<int8_t>(std::min(bit / 8 + 1, 7));
      bytes[lane_byte + 2] = bytes[lane_byte + 3] = static_cast<int8_t>(0x80);
      shift[j] = BITS == 4 ? bit : bit % 8;  // 4-bit codes are shifted out of one word
    }
    control = _mm256_load_si256(reinterpret_cast<const __m256i*>(bytes));
    shifts = _mm256_load_si256(reinterpret_cast<const __m256i*>(shift));
    mask = _mm256_set1_epi32((1 << BITS) - 1);
  }
  // The 8 codes packed at p, as floats. Reads 8 bytes (4 for 4-bit codes).
  inline __m256 codes(const uint8_t* p) const {
    if constexpr (BITS == 8) {
      return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
    } else if constexpr (BITS == 4) {
      int32_t word;
      std::memcpy(&word, p, sizeof(word));
      __m256i lanes = _mm256_srlv_epi32(_mm256_set1_epi32(word), shifts);
      return _mm256_cvtepi32_ps(_mm256_and_si256(lanes, mask));
    } else {
      int64_t word;
      std::memcpy(&word, p, sizeof(word));
      __m256i lanes = _mm256_shuffle_epi8(_mm256_set1_epi64x(word), control);
      return _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srlv_epi32(lanes, shifts), mask));
    }
  }
};

inline float horizontal_sum(__m256 v) {
  __m128 half = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  half = _mm_add_ps(half, _mm_movehl_ps(half, half));
  half = _mm_add_ss(half, _mm_movehdup_ps(half));
  return _mm_cvtss_f32(half);
}

// y[m0 .. m0+ROWS, n] for one weight row n, whose packed codes start at `codes`.
template <int BITS, int ROWS, typename S>
inline void dot_row(const Problem& p, const Unpacker<BITS>& unpack, const uint8_t* codes, int n, int m0) {
  const S* scales = static_cast<const S*>(p.scales) + static_cast<int64_t>(n) * p.groups;
  const S* biases = static_cast<const S*>(p.biases) + static_cast<int64_t>(n) * p.groups;
  const int chunks = p.group_size / 8;
  __m256 total[ROWS];
  float bias_total[ROWS];
  for (int r = 0; r < ROWS; r++) {
    total[r] = _mm256_setzero_ps();
    bias_total[r] = 0.0f;
  }
  for (int g = 0; g < p.groups; g++) {
    __m256 group[ROWS];
    for (int r = 0; r < ROWS; r++) {
      group[r] = _mm256_setzero_ps();
    }
    const int k0 = g * p.group_size;
    for (int c = 0; c < chunks; c++) {
      __m256 q = unpack.codes(codes + (static_cast<int64_t>(k0) + 8 * c) * BITS / 8);
      for (int r = 0; r < ROWS; r++) {
        const float* x = p.x + static_cast<int64_t>(m0 + r) * p.K + k0 + 8 * c;
        group[r] = _mm256_fmadd_ps(q, _mm256_loadu_ps(x), group[r]);
      }
    }
    const __m256 scale = _mm256_set1_ps(to_float<S>(scales[g]));
    const float bias = to_float<S>(biases[g]);
    for (int r = 0; r < ROWS; r++) {
      total[r] = _mm256_fmadd_ps(group[r], scale, total[r]);
      bias_total[r] += bias * p.x_sums[static_cast<int64_t>(m0 + r) * p.groups + g];
    }
  }
  for (int r = 0; r < ROWS; r++) {
    p.y[static_cast<int64_t>(m0 + r) * p.N + n] = horizontal_sum(total[r]) + bias_total[r];
  }
}

// `dot(rows, m)` over the rows of x: blocks of ROWS_PER_REGISTER_BLOCK, then the 1-3 left,
// each block size a compile-time constant (rows is a std::integral_constant).
template <typename Dot>
inline void by_row_blocks(int M, Dot dot) {
  int m = 0;
  for (; m + ROWS_PER_REGISTER_BLOCK <= M; m += ROWS_PER_REGISTER_BLOCK) {
    dot(std::integral_constant<int, ROWS_PER_REGISTER_BLOCK>{}, m);
  }
  switch (M - m) {
    case 1: dot(std::integral_constant<int, 1>{}, m); break;
    case 2: dot(std::integral_constant<int, 2>{}, m); break;
    case 3: dot(std::integral_constant<int, 3>{}, m); break;
    default: break;
  }
}

// The codes of weight row n. The generic unpacker reads past a row's last code: the matrix's
// last row comes from a padded copy in `padded`, so nothing reads past the buffer.
template <int BITS>
const uint8_t* row_codes(const Problem& p, int n, std::vector<uint8_t>& padded) {
  const uint8_t* codes = p.w + n * p.row_bytes;
  if (BITS == 4 || BITS == 8 || n != p.N - 1) {
    return codes;
  }
  padded.assign(codes, codes + p.row_bytes);
  padded.resize(p.row_bytes + 8, 0);
  return padded.data();
}

#if defined(__AVX512VBMI__) && defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__)
// With AVX-512 VBMI and VNNI, a decode meets the codes as integers: x is rounded once per
// call to int16 in each group (a step of its largest magnitude / 32767, so it is off by at
// most half a step: ~1e-5 of a product, far below float16's rounding), and each 32 codes
// are widened to int16 by one byte permute and one multishift, then multiplied and summed
// in pairs by one vpdpwssd: ~11 instructions per 32 weights where the float path takes ~28.
constexpr bool INTEGER_DOT = true;
constexpr int WIDE = 32;  // codes per widening

// Spreads the 4 * BITS bytes of 32 codes into 4 qwords of 8 codes each, and shifts code j of
// each qword down to the bottom of byte j.
template <int BITS>
struct WideUnpacker {
  __m256i permute, shifts, mask;
  __mmask32 load_mask;
  WideUnpacker() {
    alignas(32) uint8_t from[32];
    alignas(32) uint8_t shift[32];
    for (int q = 0; q < 4; q++) {
      for (int t = 0; t < 8; t++) {
        from[8 * q + t] = static_cast<uint8_t>(t < BITS ? q * BITS + t : 0);
        shift[8 * q + t] = static_cast<uint8_t>(t * BITS);
      }
    }
    permute = _mm256_load_si256(reinterpret_cast<const __m256i*>(from));
    shifts = _mm256_load_si256(reinterpret_cast<const __m256i*>(shift));
    mask = _mm256_set1_epi8(static_cast<char>((1 << BITS) - 1));
    load_mask = BITS == 8 ? 0xFFFFFFFFu : (1u << (4 * BITS)) - 1;  // never past the codes
  }
  // The 32 codes packed at p, as int16; 4-bit ones even codes first (round_x's even_first
  // puts x in the same order, and a dot product does not mind). The permute and shift
  // tables serve the widths that straddle bytes (2, 3, 5, 6).
  inline __m512i codes(const uint8_t* p) const {
    if constexpr (BITS == 8) {  // a code a byte: only the widening
      return _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    } else if constexpr (BITS == 4) {  // two a byte: low nibbles are the even codes
      const __m256i pairs = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
      const __m256i even = _mm256_and_si256(pairs, _mm256_set1_epi16(0x0F));
      const __m256i odd = _mm256_srli_epi16(pairs, 4);
      return _mm512_inserti64x4(_mm512_castsi256_si512(even), odd, 1);
    }
    const __m256i bytes = _mm256_maskz_loadu_epi8(load_mask, p);
    const __m256i spread = _mm256_permutexvar_epi8(permute, bytes);
    const __m256i fields = _mm256_multishift_epi64_epi8(shifts, spread);
    return _mm512_cvtepu8_epi16(_mm256_and_si256(fields, mask));
  }
};

// The scales or biases of groups [g, g + 16) of a row (fewer at its end), as floats.
template <typename S>
inline __m512 load_16(const S* values, int g, int groups) {
  const int left = groups - g;
  const __mmask16 mask = left >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << left) - 1);
  if constexpr (std::is_same_v<S, float>) {
    return _mm512_maskz_loadu_ps(mask, values + g);
  } else if constexpr (std::is_same_v<S, uint16_t>) {  // float16
    return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, values + g));
  } else {  // bfloat16: its bits are a float's top half
    const __m256i bits = _mm256_maskz_loadu_epi16(mask, reinterpret_cast<const uint16_t*>(values + g));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
  }
}

// A row's steps are written 16 at a time: each row of them gets whole blocks of 16.
inline int steps_stride(int groups) {
  return (groups + 15) / 16 * 16;
}

// Per weight row, the scalar work of each group is done once, 16 groups at a time, before
// the codes are read: the float each group's integer sum is multiplied by (its scale times
// x's step) and the bias term of the whole row. A code-reading loop is then only unpacking,
// one vpdpwssd per 32 codes, and one conversion and FMA per group.

template <int BITS, int ROWS, int CHUNKS, typename S>
inline void dot_row_wide(const Problem& p, const WideUnpacker<BITS>& unpack, const uint8_t* codes, int n, int m0, float* steps) {
  const S* scales = static_cast<const S*>(p.scales) + static_cast<int64_t>(n) * p.groups;
  const S* biases = static_cast<const S*>(p.biases) + static_cast<int64_t>(n) * p.groups;
  // As if the codes were centred on zero, so that x's rounding meets terms half as large:
  // s * sum (q - c) x  =  s * step * sum q x_code  -  s * c * step * sum x_code, and with
  // the sum of x itself, s * (q - c) + (b + s * c) = s * q + b, so a group's product is
  //     s * step * sum q x_code  +  b * sum x  +  s * c * (sum x - step * sum x_code)
  // where the last bracket (x_lost) is known per group of x. The codes stay unsigned.
  constexpr int CENTRE = 1 << (BITS - 1);
  constexpr int GROUP = CHUNKS * WIDE;
  const int stride = steps_stride(p.groups);
  __m512 bias_total[ROWS];
  for (int r = 0; r < ROWS; r++) {
    bias_total[r] = _mm512_setzero_ps();
  }
  for (int g = 0; g < p.groups; g += 16) {
    const __m512 scale = load_16(scales, g, p.groups);
    const __m512 bias = load_16(biases, g, p.groups);
    const __m512 centred = _mm512_mul_ps(scale, _mm512_set1_ps(CENTRE));
    for (int r = 0; r < ROWS; r++) {
      const int64_t at = static_cast<int64_t>(m0 + r) * p.groups;
      _mm512_storeu_ps(steps + r * stride + g, _mm512_mul_ps(scale, load_16(p.x_steps + at, g, p.groups)));
      bias_total[r] = _mm512_fmadd_ps(bias, load_16(p.x_sums + at, g, p.groups), bias_total[r]);
      bias_total[r] = _mm512_fmadd_ps(centred, load_16(p.x_lost + at, g, p.groups), bias_total[r]);
    }
  }
  // Two accumulators a row, for even and odd groups: one FMA chain would wait on itself.
  // (Indexed by constants only: an accumulator chosen at run time lives on the stack.)
  __m512 even[ROWS], odd[ROWS];
  for (int r = 0; r < ROWS; r++) {
    even[r] = odd[r] = _mm512_setzero_ps();
  }
  const int16_t* x_codes = p.x_codes + static_cast<int64_t>(m0) * p.K;
  const int K = p.K, groups = p.groups;
  auto add_group = [&](int g, __m512* total) {
    const uint8_t* group_codes = codes + static_cast<int64_t>(g) * GROUP * BITS / 8;
    __m512i sums[ROWS];
    for (int r = 0; r < ROWS; r++) {
      sums[r] = _mm512_setzero_si512();
    }
    for (int c = 0; c < CHUNKS; c++) {
      const __m512i q = unpack.codes(group_codes + WIDE * c * BITS / 8);
      for (int r = 0; r < ROWS; r++) {
        const int16_t* x = x_codes + static_cast<int64_t>(r) * K + g * GROUP + WIDE * c;
        sums[r] = _mm512_dpwssd_epi32(sums[r], q, _mm512_loadu_si512(x));
      }
    }
    for (int r = 0; r < ROWS; r++) {
      const __m512 step = _mm512_set1_ps(steps[r * stride + g]);
      total[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums[r]), step, total[r]);
    }
  };
  int g = 0;
  for (; g + 2 <= groups; g += 2) {
    add_group(g, even);
    add_group(g + 1, odd);
  }
  if (g < groups) {
    add_group(g, even);
  }
  for (int r = 0; r < ROWS; r++) {
    p.y[static_cast<int64_t>(m0 + r) * p.N + n] =
        _mm512_reduce_add_ps(_mm512_add_ps(even[r], odd[r])) + _mm512_reduce_add_ps(bias_total[r]);
  }
}

template <int BITS, int CHUNKS, typename S>
void dot_rows_wide_grouped(const Problem& p, int n0, int n1) {
  static const WideUnpacker<BITS> unpack;
  thread_local std::vector<float> steps;
  steps.resize(static_cast<size_t>(ROWS_PER_REGISTER_BLOCK) * steps_stride(p.groups));
  for (int n = n0; n < n1; n++) {
    const uint8_t* codes = p.w + n * p.row_bytes;  // masked loads: the last row needs no copy
    by_row_blocks(p.M, [&](auto rows, int m) {
      dot_row_wide<BITS, decltype(rows)::value, CHUNKS, S>(p, unpack, codes, n, m, steps.data());
    });
  }
}

// Each group size mlx quantizes with (32, 64, 128) is its own loop, unrolled.
template <int BITS, typename S>
void dot_rows_wide(const Problem& p, int n0, int n1) {
  switch (p.group_size) {
    case 32: return dot_rows_wide_grouped<BITS, 1, S>(p, n0, n1);
    case 64: return dot_rows_wide_grouped<BITS, 2, S>(p, n0, n1);
    default: return dot_rows_wide_grouped<BITS, 4, S>(p, n0, n1);  // 128 (integer_group)
  }
}

// x rounded to int16 in each group (`codes`), the value of one step per group (`steps`), and
// what the rounding lost of each group's sum (`lost`, from the group sums `sums`). With
// `even_first` (4-bit codes), each 32 of x are stored as their 16 even then their 16 odd.
void round_x(const float* x, int M, int K, int group_size, const float* sums, bool even_first, int16_t* codes, float* steps, float* lost) {
  const int groups = K / group_size;
  for (int m = 0; m < M; m++) {
    for (int g = 0; g < groups; g++) {
      const int64_t start = static_cast<int64_t>(m) * K + g * group_size;
      __m512 largest = _mm512_setzero_ps();
      for (int i = 0; i < group_size; i += 16) {
        largest = _mm512_max_ps(largest, _mm512_abs_ps(_mm512_loadu_ps(x + start + i)));
      }
      const float top = _mm512_reduce_max_ps(largest);
      const int64_t at = static_cast<int64_t>(m) * groups + g;
      steps[at] = top / 32767.0f;
      const __m512 per_step = _mm512_set1_ps(top > 0.0f ? 32767.0f / top : 0.0f);
      __m512i kept = _mm512_setzero_si512();
      for (int i = 0; i < group_size; i += 16) {
        const __m512i rounded = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(x + start + i), per_step));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(codes + start + i), _mm512_cvtsepi32_epi16(rounded));
        kept = _mm512_add_epi32(kept, rounded);
      }
      lost[at] = sums[at] - steps[at] * static_cast<float>(_mm512_reduce_add_epi32(kept));
      for (int c = 0; even_first && c < group_size; c += WIDE) {
        int16_t natural[WIDE];
        std::memcpy(natural, codes + start + c, sizeof(natural));
        for (int j = 0; j < WIDE / 2; j++) {
          codes[start + c + j] = natural[2 * j];
          codes[start + c + WIDE / 2 + j] = natural[2 * j + 1];
        }
      }
    }
  }
}
#else
constexpr bool INTEGER_DOT = false;
constexpr int WIDE = 32;
template <int BITS, typename S>
void dot_rows_wide(const Problem&, int, int) {}
void round_x(const float*, int, int, int, const float*, bool, int16_t*, float*, float*) {}
#endif

template <int BITS, typename S>
void dot_rows(const Problem& p, int n0, int n1) {
  if (p.x_codes != nullptr) {
    dot_rows_wide<BITS, S>(p, n0, n1);
    return;
  }
  static const Unpacker<BITS> unpack;
  std::vector<uint8_t> padded;
  for (int n = n0; n < n1; n++) {
    const uint8_t* codes = row_codes<BITS>(p, n, padded);
    by_row_blocks(p.M, [&](auto rows, int m) {
      dot_row<BITS, decltype(rows)::value, S>(p, unpack, codes, n, m);
    });
  }
}

// Rows [n0, n1) of the weights as floats, row-major (n1 - n0, K), into `out`.
template <int BITS, typename S>
void dequantize_rows(const Problem& p, int n0, int n1, float* out) {
  static const Unpacker<BITS> unpack;
  std::vector<uint8_t> padded;
  const int chunks = p.group_size / 8;
  for (int n = n0; n < n1; n++) {
    const uint8_t* codes = row_codes<BITS>(p, n, padded);
    const S* scales = static_cast<const S*>(p.scales) + static_cast<int64_t>(n) * p.groups;
    const S* biases = static_cast<const S*>(p.biases) + static_cast<int64_t>(n) * p.groups;
    float* row = out + static_cast<int64_t>(n - n0) * p.K;
    for (int g = 0; g < p.groups; g++) {
      const __m256 scale = _mm256_set1_ps(to_float<S>(scales[g]));
      const __m256 bias = _mm256_set1_ps(to_float<S>(biases[g]));
      for (int c = 0; c < chunks; c++) {
        const int k = g * p.group_size + 8 * c;
        __m256 q = unpack.codes(codes + static_cast<int64_t>(k) * BITS / 8);
        _mm256_storeu_ps(row + k, _mm256_fmadd_ps(q, scale, bias));  // mlx's s * q + b
      }
    }
  }
}

template <int BITS, typename S>
void gemm_by_tiles(const Problem& p) {
  const int tile_rows = std::max<int>(8, static_cast<int>(TILE_FLOATS / p.K));
  std::vector<float> tile(static_cast<size_t>(std::min(tile_rows, p.N)) * p.K);
  for (int n0 = 0; n0 < p.N; n0 += tile_rows) {
    const int n1 = std::min(p.N, n0 + tile_rows);
    dequantize_rows<BITS, S>(p, n0, n1, tile.data());
    cblas_sgemm(ROW_MAJOR, NO_TRANS, TRANS, p.M, n1 - n0, p.K, 1.0f, p.x, p.K, tile.data(),
                p.K, 0.0f, p.y + n0, p.N);
  }
}

template <int BITS, typename S>
void run(const Problem& p) {
  if (p.M >= gemm_rows_) {
    gemm_by_tiles<BITS, S>(p);
    return;
  }
  auto& pool = ThreadPool::instance();
  const int64_t work = static_cast<int64_t>(p.N) * p.K * p.M;
  int chunks = static_cast<int>(std::min<int64_t>(work / WORK_PER_CHUNK, 8 * pool.threads()));
  chunks = std::max(1, std::min(chunks, p.N));
  const int rows_per_chunk = (p.N + chunks - 1) / chunks;
  pool.parallel_for(chunks, [&](int chunk) {
    const int n0 = chunk * rows_per_chunk;
    dot_rows<BITS, S>(p, n0, std::min(p.N, n0 + rows_per_chunk));
  });
}

template <typename S>
void run_bits(const Problem& p, int bits) {
  switch (bits) {
    case 2: return run<2, S>(p);
    case 3: return run<3, S>(p);
    case 4: return run<4, S>(p);
    case 5: return run<5, S>(p);
    case 6: return run<6, S>(p);
    case 8: return run<8, S>(p);
    default: throw std::invalid_argument("affine_matmul: unsupported bits " + std::to_string(bits));
  }
}

void sum_groups(const float* x, int M, int K, int group_size, float* sums) {
  const int groups = K / group_size;
  for (int m = 0; m < M; m++) {
    for (int g = 0; g < groups; g++) {
      const float* start = x + static_cast<int64_t>(m) * K + g * group_size;
      __m256 total = _mm256_setzero_ps();
      for (int i = 0; i < group_size; i += 8) {
        total = _mm256_add_ps(total, _mm256_loadu_ps(start + i));
      }
      sums[static_cast<int64_t>(m) * groups + g] = horizontal_sum(total);
    }
  }
}

// The group sizes the integer dot is unrolled for: mlx quantizes with these.
bool integer_group(int group_size) {
  return group_size == 32 || group_size == 64 || group_size == 128;
}

void check(bool condition, const std::string& message) {
  if (!condition) {
    throw std::invalid_argument("affine_matmul: " + message);
  }
}

}  // namespace

bool integer_dot() {
  return INTEGER_DOT;
}

int gemm_rows() {
  return gemm_rows_;
}

void set_gemm_rows(int rows) {
  gemm_rows_ = std::max(1, rows);
}

mx::array affine_matmul(
    const mx::array& x,
    const mx::array& w,
    const mx::array& scales,
    const mx::array& biases,
    int group_size,
    int bits) {
  check(x.dtype() == mx::float32, "x must be float32");
  check(x.ndim() >= 1 && w.ndim() == 2, "x must have a last axis and w must be 2-D");
  check(w.dtype() == mx::uint32, "w must be uint32 (mlx.core.quantize's packing)");
  check(bits == 2 || bits == 3 || bits == 4 || bits == 5 || bits == 6 || bits == 8,
        "bits must be 2, 3, 4, 5, 6 or 8, not " + std::to_string(bits));
  check(group_size % 8 == 0 && group_size > 0, "group_size must be a multiple of 8");
  const int K = x.shape(-1);
  const int N = w.shape(0);
  check(static_cast<int64_t>(w.shape(1)) * 32 == static_cast<int64_t>(K) * bits,
        "w holds " + std::to_string(w.shape(1) * 32 / bits) + " codes a row, x has " +
            std::to_string(K));
  check(K % group_size == 0, "K must be a multiple of group_size");
  check(scales.shape() == biases.shape() && scales.ndim() == 2 && scales.shape(0) == N &&
            scales.shape(1) == K / group_size,
        "scales and biases must be (N, K / group_size)");
  check(scales.dtype() == biases.dtype() &&
            (scales.dtype() == mx::float32 || scales.dtype() == mx::float16 ||
             scales.dtype() == mx::bfloat16),
        "scales and biases must share a float dtype");
  auto shape = x.shape();
  shape.back() = N;
  auto stream = mx::default_stream(mx::Device::cpu);
  return mx::array(
      shape, mx::float32, std::make_shared<AffineMatmul>(stream, group_size, bits),
      {mx::contiguous(x, false, stream), mx::contiguous(w, false, stream),
       mx::contiguous(scales, false, stream), mx::contiguous(biases, false, stream)});
}

void AffineMatmul::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  const auto& x = inputs[0];
  const auto& w = inputs[1];
  const auto& scales = inputs[2];
  const auto& biases = inputs[3];
  auto& y = outputs[0];
  y.set_data(mx::allocator::malloc(y.nbytes()));

  auto& encoder = mx::cpu::get_command_encoder(stream());
  encoder.set_input_array(x);
  encoder.set_input_array(w);
  encoder.set_input_array(scales);
  encoder.set_input_array(biases);
  encoder.set_output_array(y);

  Problem p{};
  p.K = x.shape(-1);
  p.M = static_cast<int>(x.size() / p.K);
  p.N = w.shape(0);
  p.group_size = group_size_;
  p.groups = p.K / group_size_;
  p.row_bytes = static_cast<int64_t>(w.shape(1)) * 4;
  p.x = x.data<float>();
  p.w = reinterpret_cast<const uint8_t*>(w.data<uint32_t>());
  p.scales = scales.data<void>();
  p.biases = biases.data<void>();
  p.y = y.data<float>();
  const auto dtype = scales.dtype();
  const int bits = bits_;
  encoder.dispatch([p, dtype, bits]() mutable {
    std::vector<float> x_sums(static_cast<size_t>(p.M) * p.groups);
    sum_groups(p.x, p.M, p.K, p.group_size, x_sums.data());
    p.x_sums = x_sums.data();
    std::vector<int16_t> x_codes;
    std::vector<float> x_steps, x_lost;
    if (INTEGER_DOT && p.M < gemm_rows_ && integer_group(p.group_size)) {
      x_codes.resize(static_cast<size_t>(p.M) * p.K);
      x_steps.resize(static_cast<size_t>(p.M) * p.groups);
      x_lost.resize(static_cast<size_t>(p.M) * p.groups);
      round_x(p.x, p.M, p.K, p.group_size, p.x_sums, bits == 4, x_codes.data(), x_steps.data(), x_lost.data());
      p.x_codes = x_codes.data();
      p.x_steps = x_steps.data();
      p.x_lost = x_lost.data();
    }
    if (dtype == mx::float32) {
      run_bits<float>(p, bits);
    } else if (dtype == mx::float16) {
      run_bits<uint16_t>(p, bits);
    } else {
      run_bits<BFloat16>(p, bits);
    }
  });
}

void AffineMatmul::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error("TandemAffineMatmul runs on the CPU only");
}

bool AffineMatmul::is_equivalent(const mx::Primitive& other) const {
  const auto& that = static_cast<const AffineMatmul&>(other);
  return group_size_ == that.group_size_ && bits_ == that.bits_;
}

}  // namespace tandem_kernels
