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
#include <ATen/Dispatch.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <cstdint>
#include <vector>

namespace {

constexpr int64_t kLine = 64;  // bytes per cache line

template <typename T>
inline void rotate_pair(T* __restrict x1, T* __restrict x2, int64_t n, float c, float s) {
  for (int64_t t = 0; t < n; ++t) {
    const float a = static_cast<float>(x1[t]);
    const float b = static_cast<float>(x2[t]);
    x1[t] = static_cast<T>(a * c - b * s);
    x2[t] = static_cast<T>(b * c + a * s);
  }
}

// One (block, head) K region, transposed: dim d of token t at d * bs + t. A rotated pair is two rows of bs tokens.
// `BS` > 0: the block size known at compile time (the common ones), so each row is a fixed run of vector ops.
template <typename T, int64_t BS>
inline void rotate_transposed(T* k, const float* cos, const float* sin, float sign, int64_t bs, int64_t half,
                              bool neox) {
  const int64_t n = BS > 0 ? BS : bs;
  for (int64_t i = 0; i < half; ++i) {
    const int64_t d1 = neox ? i : 2 * i;
    const int64_t d2 = neox ? i + half : 2 * i + 1;
    rotate_pair(k + d1 * n, k + d2 * n, n, cos[i], sign * sin[i]);
  }
}

template <typename T>
inline void rotate_transposed_any(T* k, const float* cos, const float* sin, float sign, int64_t bs, int64_t half,
                                  bool neox) {
  switch (bs) {
    case 16: return rotate_transposed<T, 16>(k, cos, sin, sign, bs, half, neox);
    case 32: return rotate_transposed<T, 32>(k, cos, sin, sign, bs, half, neox);
    case 64: return rotate_transposed<T, 64>(k, cos, sin, sign, bs, half, neox);
    case 128: return rotate_transposed<T, 128>(k, cos, sin, sign, bs, half, neox);
    default: return rotate_transposed<T, 0>(k, cos, sin, sign, bs, half, neox);
  }
}

// One (block, head) K region, row-major: dim d of token t at t * hd + d.
template <typename T>
inline void rotate_row_major(T* k, const float* cos, const float* sin, float sign, int64_t bs, int64_t hd,
                             int64_t half, bool neox, float* s_buf) {
  for (int64_t i = 0; i < half; ++i) s_buf[i] = sign * sin[i];
  for (int64_t t = 0; t < bs; ++t) {
    T* row = k + t * hd;
    if (neox) {
      T* __restrict x1 = row;
      T* __restrict x2 = row + half;
      for (int64_t i = 0; i < half; ++i) {
        const float a = static_cast<float>(x1[i]);
        const float b = static_cast<float>(x2[i]);
        x1[i] = static_cast<T>(a * cos[i] - b * s_buf[i]);
        x2[i] = static_cast<T>(b * cos[i] + a * s_buf[i]);
      }
    } else {
      for (int64_t i = 0; i < half; ++i) {
        const float a = static_cast<float>(row[2 * i]);
        const float b = static_cast<float>(row[2 * i + 1]);
        row[2 * i] = static_cast<T>(a * cos[i] - b * s_buf[i]);
        row[2 * i + 1] = static_cast<T>(b * cos[i] + a * s_buf[i]);
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
  std::vector<T*> bases(layers);
  std::vector<int64_t> block_stride(layers), head_stride(layers);
  for (int64_t l = 0; l < layers; ++l) {
    bases[l] = caches[l].data_ptr<T>();
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
      T* block = bases[l] + ids[i] * block_stride[l];
      // The next unit's first K region: a new block is a jump the hardware prefetcher cannot follow.
      const T* next = u + 1 < end ? bases[(u + 1) / n] + ids[(u + 1) % n] * block_stride[(u + 1) / n] : nullptr;
      for (int64_t h = 0; h < heads; ++h) {
        T* k = block + h * head_stride[l];
        const T* ahead = h + 1 < heads ? k + head_stride[l] : next;
        if (ahead != nullptr) {
          for (int64_t off = 0; off < region; off += kLine / sizeof(T)) __builtin_prefetch(ahead + off, 1, 3);
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
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, first.scalar_type(), "relocate_keys_", [&] {
    relocate_impl<scalar_t>(caches, ids, ds, n, table, rotary_dim, block_size, head_dim, is_neox, transposed);
  });
}

}  // namespace

TORCH_LIBRARY(spanq, m) {
  m.def(
      "relocate_keys_(Tensor(a!)[] kv_caches, int[] block_ids, int[] deltas, Tensor cos_sin, int block_size, "
      "int head_dim, int rotary_dim, bool is_neox, bool transposed) -> ()");
}

TORCH_LIBRARY_IMPL(spanq, CPU, m) { m.impl("relocate_keys_", &relocate_keys_); }
