/* What the integer products over the K types' blocks (q_k_int16.c, q_k_tiles.c, q_k_steps.c) share: the
 * order of their float arithmetic (struct i8acc, i8_result), a super-block's weights by
 * definition (q_k_weight_ref) and unpacked for AVX2 (q_k_bytes_avx2) and for AVX-512 (q_k_bytes_vnni), and the
 * vector path the products take (int8_path, chosen at run time).
 *
 * Included by layers.c after float_products.c (one library; `native_build` keys it by both).
 *
 * One order of the float arithmetic per output and row: 32 float lanes and 8 "offset" lanes
 * (struct i8acc), which a product fills as q_k_int16.c describes; the result is
 * tree32(lanes) - tree8(offset lanes): lanes l and l + 16 added, then l and l + 8, then
 * float_products.c's lanes_sum8 (tree8). Nothing depends on the rows beside, the thread or the
 * vector path: a verification's row equals a step's, and the paths equal the scalar reference
 * bit for bit (tested).
 *
 * Vector paths, chosen at run time (int8_set_path forces one): AVX-512 with VNNI, AVX2, and the
 * scalar reference. Each is compiled with its own target attribute and probed once with
 * __builtin_cpu_supports (no trial instruction can kill the process). The library is built
 * with -march=native for the machine it runs on, so the choice matters for the tests, which
 * run every path the processor can.
 */
#include <stdint.h>


enum { INT8_SCALAR = 0, INT8_AVX2 = 1, INT8_AVX512_VNNI = 2 };
/* What a product's `int8` argument asks for (int8.py's names): 0 the float path. */
enum { INT8_WIDE = 4, INT8_TILES = 5, INT8_STEP_TILES = 6 };

/* ---- the order of the float arithmetic: one output, one row ------------------------------ */

struct i8acc {
    float a[32]; /* the lanes (the K types': 0-15) */
    float m[8];  /* the offset lanes */
} __attribute__((aligned(64)));

static inline float tree8(const float *a) { return ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7])); }

#if defined(__x86_64__)
#include <immintrin.h>

/* tree8 of eight floats in two registers (lo: 0-3, hi: 4-7): t_i = h_i + h_(i+4), then
 * (t_0 + t_2) + (t_1 + t_3), the same additions as tree8's. */
static inline float tree8_sse(__m128 lo, __m128 hi) {
    __m128 t = _mm_add_ps(lo, hi);
    __m128 u = _mm_add_ps(t, _mm_movehl_ps(t, t));
    return _mm_cvtss_f32(_mm_add_ss(u, _mm_shuffle_ps(u, u, 1)));
}

/* The scalar definition below in SSE (x86-64's baseline): the same additions in the same
 * tree, so the same bits; a tenth of the instructions. A 256-row prefill spends an eighth of
 * its products' time here in scalar code. */
static inline float i8_result(const struct i8acc *A) {
    __m128 h[4];
    for (int j = 0; j < 4; j++) h[j] = _mm_add_ps(_mm_load_ps(A->a + 4 * j), _mm_load_ps(A->a + 16 + 4 * j));
    __m128 lo = _mm_add_ps(h[0], h[2]), hi = _mm_add_ps(h[1], h[3]);  /* h8 */
    return tree8_sse(lo, hi) - tree8_sse(_mm_load_ps(A->m), _mm_load_ps(A->m + 4));
}
#else
static inline float i8_result(const struct i8acc *A) {
    float h16[16], h8[8];
    for (int l = 0; l < 16; l++) h16[l] = A->a[l] + A->a[l + 16];
    for (int l = 0; l < 8; l++) h8[l] = h16[l] + h16[l + 8];
    return tree8(h8) - tree8(A->m);
}
#endif

/* The GGUF block types the kernels read (float parts aside). */
static inline int is_block_type(int type) {
    return type == T_Q4_0 || type == T_Q4_1 || type == T_Q5_0 || type == T_Q5_1 || type == T_Q8_0 || type == T_Q4_K || type == T_Q5_K || type == T_Q6_K;
}

static inline int is_k_type(int type) { return type == T_Q4_K || type == T_Q5_K || type == T_Q6_K; }

/* ---- the scalar reference ---------------------------------------------------------------- */

/* Weight e (0..255) of a super-block, unsigned (Q4_K 0..15, Q5_K 0..31, Q6_K 0..63), and the
 * integer scale of its sub-block. */
static inline int q_k_weight_ref(int type, const uint8_t *blk, int e, int *scale) {
    if (type == T_Q6_K) {
        int h = e / 128, c = (e % 128) / 32, l = e % 32;
        int lo = blk[h * 64 + (c & 1) * 32 + l], hb = (blk[128 + h * 32 + l] >> (2 * c)) & 3;
        *scale = ((const int8_t *)(blk + 192))[e / 16];
        return (c < 2 ? lo & 15 : lo >> 4) | (hb << 4);
    }
    int j = e / 32, l = e % 32, m;
    scale_min_k4(j, blk + 4, scale, &m);
    const uint8_t *qs = blk + (type == T_Q5_K ? 48 : 16);
    int q = (qs[(j / 2) * 32 + l] >> ((j % 2) * 4)) & 15;
    if (type == T_Q5_K) q |= ((blk[16 + l] >> j) & 1) << 4;
    return q;
}

/* ---- the vector paths -------------------------------------------------------------------- */
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define I8_X86 1
#define AVX2_TARGET __attribute__((target("avx2,fma,f16c")))
#define VNNI_TARGET __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512dq,avx512vl,avx512vnni")))
#define INLINE inline __attribute__((always_inline))

/* The eight 6-bit scales and minimums of a Q4_K/Q5_K super-block as bytes, scale_min_k4's
 * arithmetic four bytes at a time. */
static inline void q4_k_scales(const uint8_t *q, uint64_t *sc, uint64_t *mn) {
    uint32_t w0, w1, w2;
    memcpy(&w0, q, 4), memcpy(&w1, q + 4, 4), memcpy(&w2, q + 8, 4);
    uint32_t s_hi = (w2 & 0x0f0f0f0fu) | (((w0 >> 6) & 0x03030303u) << 4);
    uint32_t m_hi = ((w2 >> 4) & 0x0f0f0f0fu) | (((w1 >> 6) & 0x03030303u) << 4);
    *sc = (w0 & 0x3f3f3f3fu) | (uint64_t)s_hi << 32;
    *mn = (w1 & 0x3f3f3f3fu) | (uint64_t)m_hi << 32;
}

/* -- AVX2: a super-block's weights unpacked into a buffer once for all rows (q_k_int16.c's
 *    AVX2 product reads them): stores and loads of one size, which the processor forwards (a
 *    load spanning two stores waits for both to reach the cache). */

/* A super-block's weights q, unsigned, in order. */
struct unpackedk {
    uint8_t q[256];
} __attribute__((aligned(64)));

/* A super-block into `u`; sets d and the offset's factor f (dmin, or 32 d). */
static INLINE AVX2_TARGET void q_k_bytes_avx2(int type, const uint8_t *blk, struct unpackedk *u, float *d, float *f) {
    __m256i fifteen = _mm256_set1_epi8(15);
    if (type == T_Q6_K) {
        __m256i three = _mm256_set1_epi8(3);
        for (int h = 0; h < 2; h++) {
            __m256i l0 = _mm256_loadu_si256((const __m256i *)(blk + 64 * h)), l1 = _mm256_loadu_si256((const __m256i *)(blk + 64 * h + 32));
            __m256i hb = _mm256_loadu_si256((const __m256i *)(blk + 128 + 32 * h));
            __m256i lo[4] = {_mm256_and_si256(l0, fifteen), _mm256_and_si256(l1, fifteen),
                             _mm256_and_si256(_mm256_srli_epi16(l0, 4), fifteen), _mm256_and_si256(_mm256_srli_epi16(l1, 4), fifteen)};
            for (int c = 0; c < 4; c++) {
                __m256i hi = _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 2 * c), three), 4);
                _mm256_store_si256((__m256i *)(u->q + 128 * h + 32 * c), _mm256_or_si256(lo[c], hi));
            }
        }
        *d = half_at(blk + 208);
        *f = 32.0f * *d;
        return;
    }
    const uint8_t *qs = blk + (type == T_Q5_K ? 48 : 16);
    __m256i qh = _mm256_loadu_si256((const __m256i *)(blk + 16)), one = _mm256_set1_epi8(1);
    for (int p = 0; p < 4; p++) {
        __m256i v = _mm256_loadu_si256((const __m256i *)(qs + 32 * p));
        __m256i lo = _mm256_and_si256(v, fifteen), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), fifteen);
        if (type == T_Q5_K) {
            lo = _mm256_or_si256(lo, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * p), one), 4));
            hi = _mm256_or_si256(hi, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * p + 1), one), 4));
        }
        _mm256_store_si256((__m256i *)(u->q + 64 * p), lo);
        _mm256_store_si256((__m256i *)(u->q + 64 * p + 32), hi);
    }
    *d = half_at(blk);
    *f = half_at(blk + 2);
}

/* -- AVX-512 with VNNI: a super-block's weights unpacked into registers (q_k_int16.c's VNNI
 *    products start here). */

/* A super-block's 256 weights as unsigned bytes (Q4_K 0..15, Q5_K 0..31, Q6_K 0..63): byte m of
 * q[p] is weight 64p + m. The 16-bit products' VNNI path (q_k_int16.c) starts here. */
static INLINE VNNI_TARGET void q_k_bytes_vnni(const int type, const uint8_t *blk, __m512i *q) {
    const __m512i fifteen = _mm512_set1_epi8(15);
    if (type == T_Q6_K) {
        __m512i three = _mm512_set1_epi8(3);
        __m512i sh0 = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(2), 1);  /* shifts 0 | 2 */
        __m512i sh1 = _mm512_add_epi16(sh0, _mm512_set1_epi16(4));                           /* shifts 4 | 6 */
        for (int h = 0; h < 2; h++) {
            __m512i L = _mm512_loadu_si512((const void *)(blk + 64 * h));
            __m512i H = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(blk + 128 + 32 * h)));
            q[2 * h] = _mm512_or_si512(_mm512_and_si512(L, fifteen),
                                       _mm512_slli_epi16(_mm512_and_si512(_mm512_srlv_epi16(H, sh0), three), 4));
            q[2 * h + 1] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(L, 4), fifteen),
                                           _mm512_slli_epi16(_mm512_and_si512(_mm512_srlv_epi16(H, sh1), three), 4));
        }
        return;
    }
    const uint8_t *qs = blk + (type == T_Q5_K ? 48 : 16);
    __m512i H = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(blk + 16))), one = _mm512_set1_epi8(1);
    for (int p = 0; p < 4; p++) {
        __m256i v = _mm256_loadu_si256((const __m256i *)(qs + 32 * p));
        q[p] = _mm512_and_si512(_mm512_inserti64x4(_mm512_castsi256_si512(v), _mm256_srli_epi16(v, 4), 1), fifteen);
        if (type == T_Q5_K) {  /* bit 2p of qh for the low 32, 2p + 1 for the high */
            __m512i sh = _mm512_inserti64x4(_mm512_set1_epi16((short)(2 * p)), _mm256_set1_epi16((short)(2 * p + 1)), 1);
            q[p] = _mm512_or_si512(q[p], _mm512_slli_epi16(_mm512_and_si512(_mm512_srlv_epi16(H, sh), one), 4));
        }
    }
}

#endif

/* ---- which path ---------------------------------------------------------------------------- */

static int int8_path_now = -1; /* -1: not probed yet */

/* Whether the processor runs `path` (asked of the processor, never tried). */
static int int8_runs(int path) {
    if (path == INT8_SCALAR) return 1;
#ifdef I8_X86
    __builtin_cpu_init();
    int avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
    if (path == INT8_AVX2) return avx2;
    if (path == INT8_AVX512_VNNI)
        return avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
               __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
#endif
    return 0;
}

/* The path the products take: the widest the processor runs unless one was forced. */
int int8_path(void) {
    if (int8_path_now < 0) {
        int best = INT8_SCALAR;
        for (int p = INT8_AVX2; p <= INT8_AVX512_VNNI; p++)
            if (int8_runs(p)) best = p;
        int8_path_now = best;
    }
    return int8_path_now;
}

/* Force `path` (-1: the widest again). Returns the path now taken, or -1 (nothing changed)
 * where the processor cannot run it. For the tests and benchmarks: set between products. */
int int8_set_path(int path) {
    if (path < 0) {
        int8_path_now = -1;
        return int8_path();
    }
    if (path > INT8_AVX512_VNNI || !int8_runs(path)) return -1;
    int8_path_now = path;
    return path;
}
