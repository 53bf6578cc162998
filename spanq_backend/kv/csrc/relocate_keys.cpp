// spanq: rotate cached keys of whole KV blocks in place (ReRoPE), one pass over K, for vLLM's CPU_ATTN caches.
//
// Each layer's cache is [num_blocks, kv_heads, block_size, 2 * head_dim] with the K half of a (block, head) a
// contiguous run of block_size * head_dim elements, stored either row-major ([tokens, head_dim]) or transposed
// ([head_dim, tokens], the AVX2 path). Block `block_ids[i]` of every layer is rotated by `deltas[i]` positions:
// each rotated pair (x1, x2) becomes (x1 cos - x2 sin, x2 cos + x1 sin) with cos/sin of |delta| from the
// model's own table ([max_positions, rotary_dim]: cos half, then sin half), sin negated for a negative delta.
// The arithmetic is float32 whatever the cache dtype; every element is read once and written once.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <bit>
#if defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif
#include <cstdint>
#include <vector>

namespace {

constexpr int64_t kLine = 64;  // bytes per cache line

// Storage types the loops run on: float as is; bfloat16 and float16 through their bits. bfloat16 is the upper
// half of a float32 (widening is a shift; narrowing rounds to nearest even, NaN stays NaN); float16 goes through
// F16C where the CPU has it, else through c10's conversion.
struct Bf16 {
  uint16_t bits;
};
struct F16 {
  uint16_t bits;
};

inline float load(float x) { return x; }
inline float load(Bf16 x) { return std::bit_cast<float>(static_cast<uint32_t>(x.bits) << 16); }
inline float load(F16 x) {
#if defined(__F16C__)
  return _cvtsh_ss(x.bits);
#else
  return static_cast<float>(c10::Half(x.bits, c10::Half::from_bits()));
#endif
}

template <typename S>
inline S store(float f);
template <>
inline float store<float>(float f) { return f; }
template <>
inline Bf16 store<Bf16>(float f) {
  const uint32_t bits = std::bit_cast<uint32_t>(f);
  const uint32_t rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
  const bool nan = (bits & 0x7FFFFFFFu) > 0x7F800000u;
  return Bf16{static_cast<uint16_t>(nan ? ((bits >> 16) | 0x40u) : rounded)};
}
template <>
inline F16 store<F16>(float f) {
#if defined(__F16C__)
  return F16{static_cast<uint16_t>(_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT))};
#else
  return F16{c10::Half(f).x};
#endif
}

template <typename T>
struct Storage {
  using type = T;
};
template <>
struct Storage<c10::BFloat16> {
  using type = Bf16;
};
template <>
struct Storage<c10::Half> {
  using type = F16;
};

#if defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
// Eight lanes at a time: widen to float32, rotate with FMAs, narrow back.
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const Bf16* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline __m256 load8(const F16* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }

inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
// float32 lanes -> bfloat16 bits in the low half of each 32-bit lane (round to nearest even; NaN stays NaN).
inline __m256i to_bf16_bits(__m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i upper = _mm256_srli_epi32(bits, 16);
  const __m256i lsb = _mm256_and_si256(upper, _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  return _mm256_blendv_epi8(rounded, _mm256_or_si256(upper, _mm256_set1_epi32(0x40)), nan);
}

// Sixteen lanes stored at once (two float32 vectors): bfloat16 packs both halves into one 256-bit store.
inline void store16(float* p, __m256 lo, __m256 hi) {
  _mm256_storeu_ps(p, lo);
  _mm256_storeu_ps(p + 8, hi);
}
inline void store16(Bf16* p, __m256 lo, __m256 hi) {
#if defined(__AVX512BF16__) && defined(__AVX512VL__)
  // The CPU's own conversion (round to nearest even); one instruction per eight lanes.
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), std::bit_cast<__m128i>(_mm256_cvtneps_pbh(lo)));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p + 8), std::bit_cast<__m128i>(_mm256_cvtneps_pbh(hi)));
  return;
#endif
  const __m256i packed = _mm256_packus_epi32(to_bf16_bits(lo), to_bf16_bits(hi));  // lo0-3 hi0-3 | lo4-7 hi4-7
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm256_permute4x64_epi64(packed, 0xD8));
}
inline void store16(F16* p, __m256 lo, __m256 hi) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(lo, _MM_FROUND_TO_NEAREST_INT));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p + 8), _mm256_cvtps_ph(hi, _MM_FROUND_TO_NEAREST_INT));
}

// x1, x2 <- (x1 cos - x2 sin, x2 cos + x1 sin), cos/sin per element (`step` 1) or one for all (`step` 0).
template <typename S>
inline void rotate_pair(S* x1, S* x2, int64_t n, const float* c, const float* s, int64_t step) {
  int64_t t = 0;
  for (; t + 16 <= n; t += 16) {
    const __m256 c0 = step ? _mm256_loadu_ps(c + t) : _mm256_set1_ps(*c);
    const __m256 s0 = step ? _mm256_loadu_ps(s + t) : _mm256_set1_ps(*s);
    const __m256 c1 = step ? _mm256_loadu_ps(c + t + 8) : c0;
    const __m256 s1 = step ? _mm256_loadu_ps(s + t + 8) : s0;
    const __m256 a0 = load8(x1 + t), a1 = load8(x1 + t + 8), b0 = load8(x2 + t), b1 = load8(x2 + t + 8);
    store16(x1 + t, _mm256_fmsub_ps(a0, c0, _mm256_mul_ps(b0, s0)), _mm256_fmsub_ps(a1, c1, _mm256_mul_ps(b1, s1)));
    store16(x2 + t, _mm256_fmadd_ps(b0, c0, _mm256_mul_ps(a0, s0)), _mm256_fmadd_ps(b1, c1, _mm256_mul_ps(a1, s1)));
  }
  for (; t < n; ++t) {
    const float a = load(x1[t]), b = load(x2[t]), ct = c[t * step], st = s[t * step];
    x1[t] = store<S>(a * ct - b * st);
    x2[t] = store<S>(b * ct + a * st);
  }
}
#else
template <typename S>
inline void rotate_pair(S* __restrict x1, S* __restrict x2, int64_t n, const float* c, const float* s, int64_t step) {
  for (int64_t t = 0; t < n; ++t) {
    const float a = load(x1[t]), b = load(x2[t]), ct = c[t * step], st = s[t * step];
    x1[t] = store<S>(a * ct - b * st);
    x2[t] = store<S>(b * ct + a * st);
  }
}
#endif

// One (block, head) K region, transposed: dim d of token t at d * bs + t. A rotated pair is two rows of bs tokens.
// `BS` > 0: the block size known at compile time (the common ones), so each row is a fixed run of vector ops.
template <typename S, int64_t BS>
inline void rotate_transposed(S* k, const float* cos, const float* sin, float sign, int64_t bs, int64_t half,
                              bool neox) {
  const int64_t n = BS > 0 ? BS : bs;
  for (int64_t i = 0; i < half; ++i) {
    const int64_t d1 = neox ? i : 2 * i;
    const int64_t d2 = neox ? i + half : 2 * i + 1;
    const float si = sign * sin[i];
    rotate_pair(k + d1 * n, k + d2 * n, n, cos + i, &si, 0);
  }
}

template <typename S>
inline void rotate_transposed_any(S* k, const float* cos, const float* sin, float sign, int64_t bs, int64_t half,
                                  bool neox) {
  switch (bs) {
    case 16: return rotate_transposed<S, 16>(k, cos, sin, sign, bs, half, neox);
    case 32: return rotate_transposed<S, 32>(k, cos, sin, sign, bs, half, neox);
    case 64: return rotate_transposed<S, 64>(k, cos, sin, sign, bs, half, neox);
    case 128: return rotate_transposed<S, 128>(k, cos, sin, sign, bs, half, neox);
    default: return rotate_transposed<S, 0>(k, cos, sin, sign, bs, half, neox);
  }
}

// One (block, head) K region, row-major: dim d of token t at t * hd + d.
template <typename S>
inline void rotate_row_major(S* k, const float* cos, const float* sin, float sign, int64_t bs, int64_t hd,
                             int64_t half, bool neox, float* s_buf) {
  for (int64_t i = 0; i < half; ++i) s_buf[i] = sign * sin[i];
  for (int64_t t = 0; t < bs; ++t) {
    S* row = k + t * hd;
    if (neox) {
      rotate_pair(row, row + half, half, cos, s_buf, 1);
    } else {
      for (int64_t i = 0; i < half; ++i) {
        const float a = load(row[2 * i]);
        const float b = load(row[2 * i + 1]);
        row[2 * i] = store<S>(a * cos[i] - b * s_buf[i]);
        row[2 * i + 1] = store<S>(b * cos[i] + a * s_buf[i]);
      }
    }
  }
}

template <typename T>
void relocate_impl(const std::vector<at::Tensor>& caches, const int64_t* ids, const int64_t* deltas, int64_t n,
                   const float* table, int64_t rotary_dim, int64_t block_size, int64_t head_dim, bool neox,
                   bool transposed) {
  const int64_t heads = caches[0].size(1);
  const int64_t half = rotary_dim / 2;
  const int64_t region = block_size * head_dim;  // elements of one (block, head) K region
  const int64_t layers = static_cast<int64_t>(caches.size());
  using S = typename Storage<T>::type;
  static_assert(sizeof(S) == sizeof(T), "storage type must match the element size");
  std::vector<S*> bases(layers);
  std::vector<int64_t> block_stride(layers), head_stride(layers);
  for (int64_t l = 0; l < layers; ++l) {
    bases[l] = reinterpret_cast<S*>(caches[l].data_ptr<T>());
    block_stride[l] = caches[l].stride(0);
    head_stride[l] = caches[l].stride(1);
  }
  // Work unit: one moved block of one layer (all its heads), in (layer, block) order so a thread streams
  // through neighbouring memory when blocks come in runs.
  const int64_t units = layers * n;
  const int64_t grain = std::max<int64_t>(1, 8192 / std::max<int64_t>(1, heads * block_size * head_dim / 64));
  at::parallel_for(0, units, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> s_buf(half);
    for (int64_t u = begin; u < end; ++u) {
      const int64_t l = u / n, i = u % n;
      const int64_t delta = deltas[i];
      const int64_t pos = delta < 0 ? -delta : delta;
      const float sign = delta < 0 ? -1.0f : 1.0f;
      const float* cos = table + pos * rotary_dim;
      const float* sin = cos + half;
      S* block = bases[l] + ids[i] * block_stride[l];
      // The next unit's first K region: a new block is a jump the hardware prefetcher cannot follow.
      const S* next = u + 1 < end ? bases[(u + 1) / n] + ids[(u + 1) % n] * block_stride[(u + 1) / n] : nullptr;
      for (int64_t h = 0; h < heads; ++h) {
        S* k = block + h * head_stride[l];
        const S* ahead = h + 1 < heads ? k + head_stride[l] : next;
        if (ahead != nullptr) {
          for (int64_t off = 0; off < region; off += kLine / sizeof(S)) __builtin_prefetch(ahead + off, 1, 3);
        }
        if (transposed) {
          rotate_transposed_any(k, cos, sin, sign, block_size, half, neox);
        } else {
          rotate_row_major(k, cos, sin, sign, block_size, head_dim, half, neox, s_buf.data());
        }
      }
    }
  });
}

void relocate_keys_(at::TensorList kv_caches, at::IntArrayRef block_ids, at::IntArrayRef deltas,
                    const at::Tensor& cos_sin, int64_t block_size, int64_t head_dim, int64_t rotary_dim,
                    bool is_neox, bool transposed) {
  TORCH_CHECK(!kv_caches.empty(), "relocate_keys_: no KV caches");
  TORCH_CHECK(block_ids.size() == deltas.size(), "relocate_keys_: block_ids and deltas must have one length");
  TORCH_CHECK(cos_sin.scalar_type() == at::kFloat && cos_sin.is_contiguous() && cos_sin.dim() == 2 &&
                  cos_sin.size(1) == rotary_dim,
              "relocate_keys_: cos_sin must be a contiguous float32 [positions, rotary_dim] table");
  TORCH_CHECK(rotary_dim % 2 == 0 && rotary_dim <= head_dim, "relocate_keys_: bad rotary_dim ", rotary_dim);
  std::vector<at::Tensor> caches(kv_caches.begin(), kv_caches.end());
  const auto& first = caches[0];
  for (const auto& kv : caches) {
    TORCH_CHECK(kv.device().is_cpu(), "relocate_keys_: CPU caches only");
    TORCH_CHECK(kv.dim() == 4 && kv.size(2) == block_size && kv.size(3) == 2 * head_dim,
                "relocate_keys_: caches must be [blocks, kv_heads, block_size, 2 * head_dim]");
    TORCH_CHECK(kv.scalar_type() == first.scalar_type() && kv.size(1) == first.size(1),
                "relocate_keys_: all caches must share dtype and head count");
    TORCH_CHECK(kv.stride(3) == 1 && kv.stride(2) == 2 * head_dim,
                "relocate_keys_: each (block, head) must be one contiguous run");
  }
  const int64_t n = static_cast<int64_t>(block_ids.size());
  if (n == 0) return;
  const int64_t* ids = block_ids.data();
  const int64_t* ds = deltas.data();
  const int64_t max_pos = cos_sin.size(0);
  for (const auto& kv : caches) {
    for (int64_t i = 0; i < n; ++i) {
      TORCH_CHECK(ids[i] >= 0 && ids[i] < kv.size(0), "relocate_keys_: block id ", ids[i], " out of range");
    }
  }
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(ds[i] > -max_pos && ds[i] < max_pos, "relocate_keys_: delta ", ds[i], " exceeds the table");
  }
  const float* table = cos_sin.data_ptr<float>();
  switch (first.scalar_type()) {
    case at::kFloat:
      return relocate_impl<float>(caches, ids, ds, n, table, rotary_dim, block_size, head_dim, is_neox, transposed);
    case at::kBFloat16:
      return relocate_impl<c10::BFloat16>(caches, ids, ds, n, table, rotary_dim, block_size, head_dim, is_neox,
                                          transposed);
    case at::kHalf:
      return relocate_impl<c10::Half>(caches, ids, ds, n, table, rotary_dim, block_size, head_dim, is_neox,
                                      transposed);
    default:
      TORCH_CHECK(false, "relocate_keys_: caches of dtype ", first.scalar_type(), " are not supported");
  }
}

}  // namespace

TORCH_LIBRARY(spanq, m) {
  m.def(
      "relocate_keys_(Tensor(a!)[] kv_caches, int[] block_ids, int[] deltas, Tensor cos_sin, int block_size, "
      "int head_dim, int rotary_dim, bool is_neox, bool transposed) -> ()");
}

TORCH_LIBRARY_IMPL(spanq, CPU, m) { m.impl("relocate_keys_", &relocate_keys_); }
