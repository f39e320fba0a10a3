// afd's own CUDA kernels for the attention node's device path (gpu-attention/src/device).
//
// The paged-attention kernel has a CPU twin in Rust that follows it step for step
// (`PagedAttention::cpu_fwd` in gpu-attention/src/device/paged.rs: same chunking, same order
// of the sums that matter), so the CPU tests check the indexing, the masks and the softmax
// bookkeeping written here; only the arithmetic's rounding differs. The linear and MoE kernels
// have twins too (gpu-attention/src/device/twins.rs: the same token tiles, lanes, strides,
// grouping of products and warp sum), tested on awkward shapes against plain dot products; a change to a
// kernel's indexing belongs in its twin as well. scripts/gpu_check.sh runs the kernels.
//
// Built by gpu-attention/build.rs with nvcc into PTX (the `cuda` feature), loaded through
// candle's module cache.

#include <stdint.h>

// ---------------------------------------------------------------------------------------------
// Paged decode attention: one thread block per (query row, query head).
//
// Keys and values live in per-layer pools of `slots = num_blocks * block_size` rows of
// `kv_heads * d` floats; a sequence's position p is slot `table[p / block_size] * block_size +
// p % block_size`. The block table is read directly: no gather of the history.
//
// The softmax runs online over chunks of PA_CHUNK keys: a running max `m` (starting at the
// sink logit, so the final max is max(sink, scores) as in the reference), a running sum `l`
// and a running weighted sum of values, each rescaled by exp(m_old - m_new) when the max
// grows. The sink adds exp(sink - m) to the denominator only.
// ---------------------------------------------------------------------------------------------

#define PA_THREADS 128
#define PA_CHUNK 128
#define PA_MAX_HEAD_DIM 256

extern "C" __global__ void __launch_bounds__(PA_THREADS)
afd_paged_attention_f32(const float* __restrict__ q,          // [rows, heads, d]
                        const float* __restrict__ k_pool,     // [slots, kv_heads, d]
                        const float* __restrict__ v_pool,     // [slots, kv_heads, d]
                        const uint32_t* __restrict__ tables,  // [seqs, max_blocks]
                        const uint32_t* __restrict__ rows,    // [rows, 2]: table, position
                        const float* __restrict__ sinks,      // [heads] when has_sinks
                        float* __restrict__ out,              // [rows, heads, d]
                        int heads, int kv_heads, int d, int block_size, int max_blocks,
                        int num_blocks, float scale, int window, int has_sinks) {
    const int h = blockIdx.x;
    const int row = blockIdx.y;
    const int tid = threadIdx.x;
    const int lane = tid & 31;
    const int warp = tid >> 5;
    const int warps = PA_THREADS / 32;
    // Query heads h0..h0+group-1 share key/value head h0 / group.
    const int kvh = h / (heads / kv_heads);

    __shared__ float qs[PA_MAX_HEAD_DIM];
    __shared__ float ps[PA_CHUNK];
    __shared__ uint32_t slot_of[PA_CHUNK];

    const uint32_t table = rows[2 * row];
    const int pos = (int)rows[2 * row + 1];
    const uint32_t* tab = tables + (size_t)table * (size_t)max_blocks;
    const float* qh = q + ((size_t)row * heads + h) * d;
    for (int e = tid; e < d; e += PA_THREADS) qs[e] = qh[e];

    // Key j is visible from position pos when pos - window < j <= pos.
    int lo = 0;
    if (window > 0 && pos + 1 > window) lo = pos + 1 - window;

    float m = has_sinks ? sinks[h] : __int_as_float(0xff800000);  // -inf
    float l = 0.f;
    float acc0 = 0.f, acc1 = 0.f;
    const int e0 = tid, e1 = tid + PA_THREADS;
    __syncthreads();

    for (int start = lo; start <= pos; start += PA_CHUNK) {
        const int count = min(PA_CHUNK, pos + 1 - start);
        for (int j = tid; j < count; j += PA_THREADS) {
            const int p = start + j;
            uint32_t block = tab[p / block_size];
            // The host checked every block id; an impossible one reads block 0, never
            // outside the pool.
            if (block >= (uint32_t)num_blocks) block = 0;
            slot_of[j] = block * (uint32_t)block_size + (uint32_t)(p % block_size);
        }
        __syncthreads();
        // Scores: one warp per key, the lanes split the head dimension.
        for (int j = warp; j < count; j += warps) {
            const float* kp = k_pool + ((size_t)slot_of[j] * kv_heads + kvh) * d;
            float s = 0.f;
            for (int e = lane; e < d; e += 32) s += qs[e] * kp[e];
            for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
            if (lane == 0) ps[j] = s * scale;
        }
        __syncthreads();
        float chunk_max = m;
        for (int j = 0; j < count; ++j) chunk_max = fmaxf(chunk_max, ps[j]);
        __syncthreads();
        for (int j = tid; j < count; j += PA_THREADS) ps[j] = expf(ps[j] - chunk_max);
        __syncthreads();
        float chunk_sum = 0.f;
        for (int j = 0; j < count; ++j) chunk_sum += ps[j];
        const float alpha = expf(m - chunk_max);
        l = l * alpha + chunk_sum;
        float a0 = 0.f, a1 = 0.f;
        for (int j = 0; j < count; ++j) {
            const float* vp = v_pool + ((size_t)slot_of[j] * kv_heads + kvh) * d;
            const float pj = ps[j];
            if (e0 < d) a0 += pj * vp[e0];
            if (e1 < d) a1 += pj * vp[e1];
        }
        acc0 = acc0 * alpha + a0;
        acc1 = acc1 * alpha + a1;
        m = chunk_max;
        __syncthreads();
    }
    const float denom = l + (has_sinks ? expf(sinks[h] - m) : 0.f);
    float* oh = out + ((size_t)row * heads + h) * d;
    if (e0 < d) oh[e0] = acc0 / denom;
    if (e1 < d) oh[e1] = acc1 / denom;
}

// ---------------------------------------------------------------------------------------------
// Linear layers over weights as stored: out[t, r] = sum_k x[t, k] * w[r, k], x and out f32,
// w bf16, f16 or MXFP4 decoded in registers, f32 accumulation. One warp per output row and up
// to LIN_TOKENS tokens per block (the weights are read once per LIN_TOKENS tokens): the shape
// of decode, where the weights' bytes are the cost. Long prompts take candle's matmul instead.
// ---------------------------------------------------------------------------------------------

#define LIN_WARPS 8
#define LIN_TOKENS 8

__device__ __forceinline__ float bf16_bits(uint32_t bits) { return __uint_as_float(bits << 16); }

__device__ __forceinline__ float f16_bits(uint32_t bits) {
    unsigned short b = (unsigned short)bits;
    float f;
    asm("{ cvt.f32.f16 %0, %1; }" : "=f"(f) : "h"(b));
    return f;
}

template <bool F16>
__device__ __forceinline__ float half_bits(uint32_t bits) {
    return F16 ? f16_bits(bits) : bf16_bits(bits);
}

// The warp's sum, in every lane.
__device__ __forceinline__ float warp_sum(float s) {
    for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    return s;
}

template <bool F16, bool VEC>
__device__ void linear_half(const float* __restrict__ x, const uint16_t* __restrict__ w,
                            float* __restrict__ out, int n, int K, int N) {
    const int lane = threadIdx.x & 31;
    const int r = blockIdx.x * LIN_WARPS + (threadIdx.x >> 5);
    const int t0 = blockIdx.y * LIN_TOKENS;
    if (r >= N || t0 >= n) return;
    const int tc = min(LIN_TOKENS, n - t0);
    float acc[LIN_TOKENS];
#pragma unroll
    for (int t = 0; t < LIN_TOKENS; ++t) acc[t] = 0.f;
    const uint16_t* wr = w + (size_t)r * K;
    if (VEC) {
        // 8 weights (16 bytes) per lane per step; the caller checked K % 8 == 0 and alignment.
        for (int k = lane * 8; k < K; k += 32 * 8) {
            const uint4 raw = *reinterpret_cast<const uint4*>(wr + k);
            float wv[8];
            wv[0] = half_bits<F16>(raw.x & 0xffffu);
            wv[1] = half_bits<F16>(raw.x >> 16);
            wv[2] = half_bits<F16>(raw.y & 0xffffu);
            wv[3] = half_bits<F16>(raw.y >> 16);
            wv[4] = half_bits<F16>(raw.z & 0xffffu);
            wv[5] = half_bits<F16>(raw.z >> 16);
            wv[6] = half_bits<F16>(raw.w & 0xffffu);
            wv[7] = half_bits<F16>(raw.w >> 16);
#pragma unroll
            for (int t = 0; t < LIN_TOKENS; ++t) {
                if (t < tc) {
                    const float4* xp = reinterpret_cast<const float4*>(x + (size_t)(t0 + t) * K + k);
                    const float4 a = xp[0], b = xp[1];
                    acc[t] += wv[0] * a.x + wv[1] * a.y + wv[2] * a.z + wv[3] * a.w +
                              wv[4] * b.x + wv[5] * b.y + wv[6] * b.z + wv[7] * b.w;
                }
            }
        }
    } else {
        for (int k = lane; k < K; k += 32) {
            const float wv = half_bits<F16>(wr[k]);
#pragma unroll
            for (int t = 0; t < LIN_TOKENS; ++t)
                if (t < tc) acc[t] += wv * x[(size_t)(t0 + t) * K + k];
        }
    }
#pragma unroll
    for (int t = 0; t < LIN_TOKENS; ++t) {
        const float s = warp_sum(acc[t]);
        if (lane == 0 && t < tc) out[(size_t)(t0 + t) * N + r] = s;
    }
}

extern "C" __global__ void __launch_bounds__(LIN_WARPS * 32)
afd_linear_bf16(const float* x, const uint16_t* w, float* out, int n, int K, int N, int vec) {
    if (vec) linear_half<false, true>(x, w, out, n, K, N);
    else linear_half<false, false>(x, w, out, n, K, N);
}

extern "C" __global__ void __launch_bounds__(LIN_WARPS * 32)
afd_linear_f16(const float* x, const uint16_t* w, float* out, int n, int K, int N, int vec) {
    if (vec) linear_half<true, true>(x, w, out, n, K, N);
    else linear_half<true, false>(x, w, out, n, K, N);
}

// MXFP4: per row, K / 32 blocks of 16 bytes (byte j: element 2j in the low nibble, 2j + 1 in
// the high one) and K / 32 E8M0 scale bytes; a value is FP4[nibble] * 2^(scale - 127).
__constant__ float AFD_FP4[16] = {0.0f,  0.5f,  1.0f,  1.5f,  2.0f,  3.0f,  4.0f,  6.0f,
                                  -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

__device__ __forceinline__ float e8m0(uint32_t s) {
    return s == 0 ? __uint_as_float(1u << 22) : __uint_as_float(s << 23);
}

// One 32-element block of row `blocks`/`scales` decoded into `wv`.
__device__ __forceinline__ void mxfp4_block(const uint8_t* blocks, const uint8_t* scales, int g,
                                            float* wv) {
    const uint4 raw = *reinterpret_cast<const uint4*>(blocks + (size_t)g * 16);
    const float s = e8m0(scales[g]);
    const uint32_t words[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
#pragma unroll
        for (int b = 0; b < 4; ++b) {
            const uint32_t byte = (words[i] >> (8 * b)) & 0xffu;
            wv[8 * i + 2 * b] = AFD_FP4[byte & 0xfu] * s;
            wv[8 * i + 2 * b + 1] = AFD_FP4[byte >> 4] * s;
        }
    }
}

// A row of MXFP4 weights against up to LIN_TOKENS rows of x: one 32-element block per lane
// per step.
__device__ __forceinline__ void mxfp4_row_dot(const float* __restrict__ x, size_t x_stride,
                                              const uint8_t* blocks, const uint8_t* scales,
                                              int K, int tc, float* acc) {
    const int lane = threadIdx.x & 31;
    for (int g = lane; g < K / 32; g += 32) {
        float wv[32];
        mxfp4_block(blocks, scales, g, wv);
#pragma unroll
        for (int t = 0; t < LIN_TOKENS; ++t) {
            if (t < tc) {
                const float4* xp = reinterpret_cast<const float4*>(x + (size_t)t * x_stride + g * 32);
                float s = 0.f;
#pragma unroll
                for (int i = 0; i < 8; ++i) {
                    const float4 a = xp[i];
                    s += wv[4 * i] * a.x + wv[4 * i + 1] * a.y + wv[4 * i + 2] * a.z +
                         wv[4 * i + 3] * a.w;
                }
                acc[t] += s;
            }
        }
    }
}

extern "C" __global__ void __launch_bounds__(LIN_WARPS * 32)
afd_linear_mxfp4(const float* __restrict__ x, const uint8_t* __restrict__ blocks,
                 const uint8_t* __restrict__ scales, float* __restrict__ out, int n, int K, int N) {
    const int lane = threadIdx.x & 31;
    const int r = blockIdx.x * LIN_WARPS + (threadIdx.x >> 5);
    const int t0 = blockIdx.y * LIN_TOKENS;
    if (r >= N || t0 >= n) return;
    const int tc = min(LIN_TOKENS, n - t0);
    float acc[LIN_TOKENS];
#pragma unroll
    for (int t = 0; t < LIN_TOKENS; ++t) acc[t] = 0.f;
    mxfp4_row_dot(x + (size_t)t0 * K, K, blocks + (size_t)r * (K / 2), scales + (size_t)r * (K / 32),
                  K, tc, acc);
#pragma unroll
    for (int t = 0; t < LIN_TOKENS; ++t) {
        const float s = warp_sum(acc[t]);
        if (lane == 0 && t < tc) out[(size_t)(t0 + t) * N + r] = s;
    }
}

// ---------------------------------------------------------------------------------------------
// Expert projections of the GPU-only baseline: pair p = (token, expert) computes
// out[p, r] = sum_k x[token_p, k] * W[expert_p, r, k] with W as stored ([E, N, K] halves, or
// MXFP4 blocks [E, N, K / 2] and scales [E, N, K / 32]). One block row of LIN_WARPS output rows
// per pair: every pair of a decode step touches its own expert.
// ---------------------------------------------------------------------------------------------

// A stored weight as f32: bf16 or f16 from its bits, f32 as it is.
template <bool F16>
__device__ __forceinline__ float widen(uint16_t bits) {
    return half_bits<F16>(bits);
}
template <bool F16>
__device__ __forceinline__ float widen(float v) {
    return v;
}

template <bool F16, typename T>
__device__ void moe_dense(const float* __restrict__ x, const uint32_t* __restrict__ pair_token,
                          const uint32_t* __restrict__ pair_expert, const T* __restrict__ w,
                          float* __restrict__ out, int K, int N) {
    const int lane = threadIdx.x & 31;
    const int r = blockIdx.x * LIN_WARPS + (threadIdx.x >> 5);
    const int p = blockIdx.y;
    if (r >= N) return;
    const float* xr = x + (size_t)pair_token[p] * K;
    const T* wr = w + ((size_t)pair_expert[p] * N + r) * K;
    float acc = 0.f;
    for (int k = lane; k < K; k += 32) acc += widen<F16>(wr[k]) * xr[k];
    acc = warp_sum(acc);
    if (lane == 0) out[(size_t)p * N + r] = acc;
}

extern "C" __global__ void __launch_bounds__(LIN_WARPS * 32)
afd_moe_bf16(const float* x, const uint32_t* pair_token, const uint32_t* pair_expert,
             const uint16_t* w, float* out, int K, int N) {
    moe_dense<false>(x, pair_token, pair_expert, w, out, K, N);
}

extern "C" __global__ void __launch_bounds__(LIN_WARPS * 32)
afd_moe_f16(const float* x, const uint32_t* pair_token, const uint32_t* pair_expert,
            const uint16_t* w, float* out, int K, int N) {
    moe_dense<true>(x, pair_token, pair_expert, w, out, K, N);
}

extern "C" __global__ void __launch_bounds__(LIN_WARPS * 32)
afd_moe_f32(const float* x, const uint32_t* pair_token, const uint32_t* pair_expert,
            const float* w, float* out, int K, int N) {
    moe_dense<false>(x, pair_token, pair_expert, w, out, K, N);
}

extern "C" __global__ void __launch_bounds__(LIN_WARPS * 32)
afd_moe_mxfp4(const float* __restrict__ x, const uint32_t* __restrict__ pair_token,
              const uint32_t* __restrict__ pair_expert, const uint8_t* __restrict__ blocks,
              const uint8_t* __restrict__ scales, float* __restrict__ out, int K, int N) {
    const int lane = threadIdx.x & 31;
    const int r = blockIdx.x * LIN_WARPS + (threadIdx.x >> 5);
    const int p = blockIdx.y;
    if (r >= N) return;
    const size_t row = (size_t)pair_expert[p] * N + r;
    float acc[LIN_TOKENS];
#pragma unroll
    for (int t = 0; t < LIN_TOKENS; ++t) acc[t] = 0.f;
    mxfp4_row_dot(x + (size_t)pair_token[p] * K, K, blocks + row * (K / 2), scales + row * (K / 32),
                  K, 1, acc);
    const float s = warp_sum(acc[0]);
    if (lane == 0) out[(size_t)p * N + r] = s;
}
