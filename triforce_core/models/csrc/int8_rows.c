/* Integer products over the stored blocks, as llama.cpp computes them: each activation row is
 * quantized to 8 bits in blocks (struct block_q8_32x8, eight blocks of 32, for the 32-weight
 * types Q4_0, Q4_1, Q8_0; struct block_q8_k for the 256-weight types Q4_K, Q5_K, Q6_K), and a
 * weight block times an activation block is a sum of small integers. One level (opt-in,
 * `TRIFORCE_INT8=1`) changes the model's numbers by up to half an 8-bit step an input; two
 * levels (below; the default for the 256-weight types) by about 1/254 of that.
 *
 * Two levels (`int8.TWO_LEVELS`, and `int8.FAST` for the 256-weight types): each row quantized,
 * then what that left (its residual) quantized with its own scales; both are multiplied by the
 * same kernels as rows of their own and the two results added. About 15 bits of each input, so
 * the model's numbers stay close to the float path's (bench/fidelity.py), for twice the integer
 * work over the same unpacked weights.
 *
 * Included by layers.c after quant_rows.c (one library; `native_build` keys it by both).
 *
 * One order of the float arithmetic. The integer sums are exact; what is rounded is their
 * combination with the scales, and that follows one order per output, written out once in the
 * scalar reference (`ref_*`) and followed by every vector path:
 *   - 32 float lanes per output and row. A 32-weight block b adds to lanes (b % 4) * 8 + j, j < 8,
 *     P_j = sum of w_e x_e over its weights e = 4j .. 4j + 3:  lane = fmaf((float)P_j, d_w d_x, lane)
 *     (four blocks' lanes side by side: a one-row product is not held up by one chain of fmas).
 *     A 256-weight super-block adds to lane l < 16 V_l = sum over p < 4, t < 4 of sc(e) q_e x_e,
 *     e = 64 p + 4 l + t (sc(e) the integer scale of e's sub-block):  lane = fmaf((float)V_l, d d_x, lane).
 *   - 8 "offset" lanes, subtracted: Q4_K and Q5_K's minimums, M_j = m_j (bsum_2j + bsum_2j+1),
 *     times dmin d_x; Q6_K's bias of 32, M_j = sc_2j bsum_2j + sc_2j+1 bsum_2j+1, times 32 d d_x
 *     (Q6_K's weights enter V_l unsigned, 0..63: one madd with the bsums where a signed product
 *     would cost two more instructions each 64 weights); Q4_1's minimum, block b into lane b % 8,
 *     fmaf((float)sum_x, -m_w d_x, lane) (eight chains: one would wait on each fma's latency).
 *   - the result: tree32(lanes) - tree8(offset lanes): lanes l and l + 16 added, then l and l + 8,
 *     then quant_rows.c's lanes_sum8 (tree8).
 * Every integer converted is below 2^24 (Q6_K's V_l, the largest: 4 x 4 x 63 x 127 x 128), so
 * exact as a float. Nothing depends on the rows beside, the thread or the vector path: a
 * verification's row equals a step's, and the paths equal the reference bit for bit (tested).
 *
 * Vector paths, chosen at run time (int8_set_path forces one): AVX-512 with VNNI (64 weights an
 * instruction pair: vpmaddubsw, vpdpwssd; 32-weight blocks with a 256-bit vpdpbusd), AVX2
 * (vpmaddubsw, vpmaddwd), and the scalar reference. Each is compiled with its own target
 * attribute and probed once with __builtin_cpu_supports (no trial instruction can kill the
 * process). The library is built with -march=native for the machine it runs on, so the choice
 * matters for the tests, which run every path the processor can.
 */
#include <stdint.h>

/* Eight activation blocks of 32 (ggml's Q8_0, with Q8_1's sum of the integers) side by side as
 * one group of 256: a vector reads the eight scales at once and two blocks' integers as one
 * 64-byte run. A row of K inputs is ceil(K / 256) groups, a last group's unused blocks zero. */
struct block_q8_32x8 {
    float d[8];      /* block i: x ~ d[i] q */
    int32_t sum[8];  /* sum of block i's integers (Q4_1's minimum) */
    int8_t qs[256];  /* block i's at 32 i */
};
/* One activation block of 256 (ggml's Q8_K). */
struct block_q8_k {
    float d;
    int8_t qs[256];
    int16_t bsums[16];  /* sum of qs per 16 */
};
_Static_assert(sizeof(struct block_q8_32x8) == 320, "block_q8_32x8 is 320 bytes");
_Static_assert(sizeof(struct block_q8_k) == 292, "block_q8_k is 292 bytes");

enum { INT8_SCALAR = 0, INT8_AVX2 = 1, INT8_AVX512_VNNI = 2 };
enum { Q8_32 = 0, Q8_K = 1 }; /* activation layouts (int8_quantize_rows' kind) */
/* What a product's `int8` argument asks for (int8.py's names): 0 the float path. */
enum { INT8_ONE_LEVEL = 1, INT8_TWO_LEVELS = 2, INT8_FAST = 3, INT8_WIDE = 4, INT8_TILES = 5, INT8_STEP_TILES = 6 };

#define I8_ROWS 16 /* activation rows sharing each unpacked group of weights */

/* ---- activations ------------------------------------------------------------------------ */

/* n floats -> n int8 with d = max|x| / 127 and q = round(x / d) (roundf: half away from zero,
 * as ggml's reference quantize_row_q8_0; its Q8_K rule differs only by a sign convention).
 * A NaN or infinity makes d NaN or infinite, so the products are too, as the float path's. */
static void q8_block(const float *x, int n, int8_t *q, float *d) {
    float amax = 0.0f;
    int nan = 0;
    for (int i = 0; i < n; i++) {
        float a = fabsf(x[i]);
        nan |= a != a;
        amax = a > amax ? a : amax;
    }
    float dd = nan ? NAN : amax / 127.0f, id = dd > 0.0f ? 1.0f / dd : 0.0f;
    for (int i = 0; i < n; i++) {
        float v = roundf(x[i] * id);
        q[i] = v != v ? 0 : v >= 127.0f ? 127 : v <= -127.0f ? -127 : (int8_t)v;
    }
    *d = dd;
}

static void quantize_q8_32(const float *x, int K, struct block_q8_32x8 *y) {
    memset(y, 0, sizeof(*y) * (size_t)((K + 255) / 256));
    for (int b = 0; b < K / 32; b++) {
        struct block_q8_32x8 *g = &y[b / 8];
        int i = b % 8, s = 0;
        q8_block(x + 32 * b, 32, g->qs + 32 * i, &g->d[i]);
        for (int e = 0; e < 32; e++) s += g->qs[32 * i + e];
        g->sum[i] = s;
    }
}

static void quantize_q8_k(const float *x, int K, struct block_q8_k *y) {
    for (int b = 0; b < K / 256; b++) {
        q8_block(x + 256 * b, 256, y[b].qs, &y[b].d);
        for (int i = 0; i < 16; i++) {
            int s = 0;
            for (int e = 0; e < 16; e++) s += y[b].qs[16 * i + e];
            y[b].bsums[i] = (int16_t)s;
        }
    }
}

/* Activation blocks a row of K inputs takes: ceil(K / 256) groups of eight 32-blocks, or K / 256. */
static inline int64_t act_blocks(int K, int kind) { return kind == Q8_K ? K / 256 : (K + 255) / 256; }

/* x [S, K] -> S rows of ceil(K/256) block_q8_32x8 (kind Q8_32) or K/256 block_q8_k (Q8_K), each
 * row on its own. Returns -1 where K is not a whole number of blocks. */
int int8_quantize_rows(const float *x, int S, int K, int kind, void *out) {
    int per = kind == Q8_K ? 256 : 32;
    if ((kind != Q8_32 && kind != Q8_K) || K <= 0 || K % per) return -1;
    for (int s = 0; s < S; s++) {
        if (kind == Q8_K)
            quantize_q8_k(x + (int64_t)s * K, K, (struct block_q8_k *)out + (int64_t)s * (K / 256));
        else
            quantize_q8_32(x + (int64_t)s * K, K, (struct block_q8_32x8 *)out + (int64_t)s * act_blocks(K, Q8_32));
    }
    return 0;
}

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

static inline int is_int8_type(int type) {
    return type == T_Q4_0 || type == T_Q4_1 || type == T_Q8_0 || type == T_Q4_K || type == T_Q5_K || type == T_Q6_K;
}

static inline int is_k_type(int type) { return type == T_Q4_K || type == T_Q5_K || type == T_Q6_K; }

/* ---- the scalar reference ---------------------------------------------------------------- */

/* Weight e (0..31) of a 32-weight block as the integer the products take: Q4_0 q - 8, Q4_1 q
 * (its minimum apart), Q8_0 q. */
static inline int ref_w32(int type, const uint8_t *blk, int e) {
    if (type == T_Q8_0) return (int8_t)blk[2 + e];
    const uint8_t *qs = blk + (type == T_Q4_1 ? 4 : 2);
    int q = e < 16 ? (qs[e] & 15) : (qs[e - 16] >> 4);
    return type == T_Q4_0 ? q - 8 : q;
}

/* Block b of a row; g its activation group (block b % 8 of it). */
static void ref_block32(int type, const uint8_t *blk, const struct block_q8_32x8 *g, int b, struct i8acc *A) {
    int32_t P[8] = {0};
    int i = b % 8;
    for (int e = 0; e < 32; e++) P[e / 4] += ref_w32(type, blk, e) * g->qs[32 * i + e];
    float dd = half_at(blk) * g->d[i], *lanes = A->a + (b % 4) * 8;
    for (int j = 0; j < 8; j++) lanes[j] = fmaf((float)P[j], dd, lanes[j]);
    if (type == T_Q4_1) A->m[i] = fmaf((float)g->sum[i], -half_at(blk + 2) * g->d[i], A->m[i]);
}

/* Weight e (0..255) of a super-block, unsigned (Q4_K 0..15, Q5_K 0..31, Q6_K 0..63), and the
 * integer scale of its sub-block. */
static inline int ref_wk(int type, const uint8_t *blk, int e, int *scale) {
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

static void ref_blockk(int type, const uint8_t *blk, const struct block_q8_k *x, struct i8acc *A) {
    int32_t V[16] = {0}, M[8];
    for (int e = 0; e < 256; e++) {
        int sc, q = ref_wk(type, blk, e, &sc);
        V[(e % 64) / 4] += sc * q * x->qs[e];
    }
    float d, f;
    if (type == T_Q6_K) {
        const int8_t *sc = (const int8_t *)(blk + 192);
        for (int j = 0; j < 8; j++) M[j] = sc[2 * j] * x->bsums[2 * j] + sc[2 * j + 1] * x->bsums[2 * j + 1];
        d = half_at(blk + 208);
        f = 32.0f * d;
    } else {
        for (int j = 0; j < 8; j++) {
            int sc, m;
            scale_min_k4(j, blk + 4, &sc, &m);
            M[j] = m * (x->bsums[2 * j] + x->bsums[2 * j + 1]);
        }
        d = half_at(blk);
        f = half_at(blk + 2);
    }
    float dd = d * x->d, dm = f * x->d;
    for (int l = 0; l < 16; l++) A->a[l] = fmaf((float)V[l], dd, A->a[l]);
    for (int j = 0; j < 8; j++) A->m[j] = fmaf((float)M[j], dm, A->m[j]);
}

/* One weight row (nb blocks) against rows [0, S) of x (ldx activation blocks apart): the definition. */
static void ref_row(int type, const uint8_t *row, const void *x, int64_t ldx, int nb, int S, struct i8acc *A) {
    int bb = block_bytes(type);
    for (int s = 0; s < S; s++)
        for (int b = 0; b < nb; b++) {
            if (is_k_type(type))
                ref_blockk(type, row + (int64_t)b * bb, (const struct block_q8_k *)x + s * ldx + b, &A[s]);
            else
                ref_block32(type, row + (int64_t)b * bb, (const struct block_q8_32x8 *)x + s * ldx + b / 8, b, &A[s]);
        }
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
static inline void k4_scales(const uint8_t *q, uint64_t *sc, uint64_t *mn) {
    uint32_t w0, w1, w2;
    memcpy(&w0, q, 4), memcpy(&w1, q + 4, 4), memcpy(&w2, q + 8, 4);
    uint32_t s_hi = (w2 & 0x0f0f0f0fu) | (((w0 >> 6) & 0x03030303u) << 4);
    uint32_t m_hi = ((w2 >> 4) & 0x0f0f0f0fu) | (((w1 >> 6) & 0x03030303u) << 4);
    *sc = (w0 & 0x3f3f3f3fu) | (uint64_t)s_hi << 32;
    *mn = (w1 & 0x3f3f3f3fu) | (uint64_t)m_hi << 32;
}

/* Q4_1's minimums of a group's first n blocks into the offset lanes. */
static inline void q4_1_mins(const float *neg_m, const struct block_q8_32x8 *g, int n, struct i8acc *A) {
    for (int i = 0; i < n; i++) A->m[i] = fmaf((float)g->sum[i], neg_m[i] * g->d[i], A->m[i]);
}

/* The 16-bit floats at byte `at` (0 or 2) of n (<= 8) blocks bb bytes apart, as floats (0 past
 * n): a group's eight d (or Q4_1's m) in one vector, the words inserted one by one (a gather
 * is slow on AMD's processors, a vector load of scalar stores waits for them). */
static INLINE AVX2_TARGET __m256 halves8(const uint8_t *blk, int bb, int n, int at) {
    uint16_t h[8];
    for (int i = 0; i < 8; i++) {
        h[i] = 0;
        if (i < n) memcpy(&h[i], blk + i * bb + at, 2);
    }
    __m128i v = _mm_cvtsi32_si128(h[0]);
    v = _mm_insert_epi16(v, h[1], 1), v = _mm_insert_epi16(v, h[2], 2), v = _mm_insert_epi16(v, h[3], 3);
    v = _mm_insert_epi16(v, h[4], 4), v = _mm_insert_epi16(v, h[5], 5), v = _mm_insert_epi16(v, h[6], 6);
    v = _mm_insert_epi16(v, h[7], 7);
    return _mm256_cvtph_ps(v);
}

/* -- AVX2: 32 weights an instruction triple (vpmaddubsw, vpmaddwd, vpaddd). A group's weights
 *    are unpacked into a buffer once for all rows: stores and loads of one size, which the
 *    processor forwards (a load spanning two stores waits for both to reach the cache). */

/* Up to eight 32-weight blocks: the weights as bytes in order (Q4_0, Q8_0: signed w and |w|;
 * Q4_1: q in `a`). */
struct unpacked32 {
    int8_t w[256];
    uint8_t a[256];
} __attribute__((aligned(64)));

/* A super-block: q (unsigned, in order) and each 32 weights' 16 pair scales (the madd's other
 * operand). */
struct unpackedk {
    uint8_t q[256];
    int16_t scw[128];
} __attribute__((aligned(64)));

static INLINE AVX2_TARGET void unpack32(int type, const uint8_t *blk, int n, struct unpacked32 *u) {
    int bb = block_bytes(type);
    for (int i = 0; i < n; i++, blk += bb) {
        __m256i w;
        if (type == T_Q8_0) {
            w = _mm256_loadu_si256((const __m256i *)(blk + 2));
        } else {
            __m128i v = _mm_loadu_si128((const __m128i *)(blk + (type == T_Q4_1 ? 4 : 2))), f = _mm_set1_epi8(15);
            w = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), f), _mm_and_si128(v, f));
            if (type == T_Q4_1) {
                _mm256_store_si256((__m256i *)(u->a + 32 * i), w);
                continue;
            }
            w = _mm256_sub_epi8(w, _mm256_set1_epi8(8));
        }
        _mm256_store_si256((__m256i *)(u->w + 32 * i), w);
        _mm256_store_si256((__m256i *)(u->a + 32 * i), _mm256_abs_epi8(w));
    }
}

/* A super-block into `u`; returns the offset lanes' 16 multipliers and sets d and the offset's
 * factor f (dmin, or 32 d). */
static INLINE AVX2_TARGET __m256i unpackk(int type, const uint8_t *blk, struct unpackedk *u, float *d, float *f) {
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
        __m256i sc = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(blk + 192)));  /* 16 scales, one per 16 */
        for (int c = 0; c < 8; c++) {  /* weights 32c.. take scales 2c (pairs 0-7) and 2c + 1 (pairs 8-15) */
            __m256i lo = _mm256_set1_epi16((int16_t)((const int8_t *)blk)[192 + 2 * c]);
            __m256i hi = _mm256_set1_epi16((int16_t)((const int8_t *)blk)[193 + 2 * c]);
            _mm256_store_si256((__m256i *)(u->scw + 16 * c), _mm256_blend_epi32(lo, hi, 0xf0));
        }
        *d = half_at(blk + 208);
        *f = 32.0f * *d;
        return sc;
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
    uint64_t scb, mnb;
    k4_scales(blk + 4, &scb, &mnb);
    for (int j = 0; j < 8; j++) _mm256_store_si256((__m256i *)(u->scw + 16 * j), _mm256_set1_epi16((int16_t)((scb >> (8 * j)) & 0xff)));
    __m128i mb = _mm_cvtsi64_si128((long long)mnb);
    *d = half_at(blk);
    *f = half_at(blk + 2);
    return _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(mb, mb));  /* m_j for bsums 2j and 2j + 1 */
}

/* The offset lanes of one row: M_j = off_2j bsum_2j + off_2j+1 bsum_2j+1, one madd. */
static INLINE AVX2_TARGET void offset_lanes(__m256i off, float f, const struct block_q8_k *x, struct i8acc *A) {
    __m256i M = _mm256_madd_epi16(off, _mm256_loadu_si256((const __m256i *)x->bsums));
    _mm256_store_ps(A->m, _mm256_fmadd_ps(_mm256_cvtepi32_ps(M), _mm256_set1_ps(f * x->d), _mm256_load_ps(A->m)));
}

static INLINE AVX2_TARGET void avx2_k(const int type, const uint8_t *row, const struct block_q8_k *x, int64_t ldx, int nb,
                                      int S, struct i8acc *A) {
    struct unpackedk u;
    for (int b = 0; b < nb; b++) {
        float d, f;
        __m256i off = unpackk(type, row + (int64_t)b * block_bytes(type), &u, &d, &f);
        for (int s = 0; s < S; s++) {
            const struct block_q8_k *xs = x + s * ldx + b;
            __m256i vlo = _mm256_setzero_si256(), vhi = vlo;
            for (int p = 0; p < 4; p++) {
                __m256i p0 = _mm256_maddubs_epi16(_mm256_load_si256((const __m256i *)(u.q + 64 * p)),
                                                  _mm256_loadu_si256((const __m256i *)(xs->qs + 64 * p)));
                __m256i p1 = _mm256_maddubs_epi16(_mm256_load_si256((const __m256i *)(u.q + 64 * p + 32)),
                                                  _mm256_loadu_si256((const __m256i *)(xs->qs + 64 * p + 32)));
                vlo = _mm256_add_epi32(vlo, _mm256_madd_epi16(p0, _mm256_load_si256((const __m256i *)(u.scw + 32 * p))));
                vhi = _mm256_add_epi32(vhi, _mm256_madd_epi16(p1, _mm256_load_si256((const __m256i *)(u.scw + 32 * p + 16))));
            }
            __m256 dd = _mm256_set1_ps(d * xs->d);
            _mm256_store_ps(A[s].a, _mm256_fmadd_ps(_mm256_cvtepi32_ps(vlo), dd, _mm256_load_ps(A[s].a)));
            _mm256_store_ps(A[s].a + 8, _mm256_fmadd_ps(_mm256_cvtepi32_ps(vhi), dd, _mm256_load_ps(A[s].a + 8)));
            offset_lanes(off, f, xs, &A[s]);
        }
    }
}

/* One group of n (<= 8) blocks against all S rows, as vnni_32_group. */
static INLINE AVX2_TARGET void avx2_32_group(const int type, const uint8_t *blk, const int n, const struct block_q8_32x8 *g,
                                             int64_t ldx, int S, struct i8acc *A, __m256 dw, const float *neg_m) {
    struct unpacked32 u;
    __m256i ones = _mm256_set1_epi16(1);
    unpack32(type, blk, n, &u);
    for (int s = 0; s < S; s++, g += ldx) {
        __m256 a[4], dd = _mm256_mul_ps(dw, _mm256_loadu_ps(g->d));
        for (int j = 0; j < 4; j++) a[j] = _mm256_load_ps(A[s].a + 8 * j);
        for (int i = 0; i < n; i++) {
            __m256i X = _mm256_loadu_si256((const __m256i *)(g->qs + 32 * i)), ua = _mm256_load_si256((const __m256i *)(u.a + 32 * i));
            if (type != T_Q4_1) X = _mm256_sign_epi8(X, _mm256_load_si256((const __m256i *)(u.w + 32 * i)));
            __m256i P = _mm256_madd_epi16(_mm256_maddubs_epi16(ua, X), ones);
            a[i % 4] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(P), _mm256_permutevar8x32_ps(dd, _mm256_set1_epi32(i)), a[i % 4]);
        }
        for (int j = 0; j < 4; j++) _mm256_store_ps(A[s].a + 8 * j, a[j]);
        if (type == T_Q4_1) q4_1_mins(neg_m, g, n, &A[s]);
    }
}

static INLINE AVX2_TARGET void avx2_32(const int type, const uint8_t *row, const struct block_q8_32x8 *x, int64_t ldx, int nb,
                                       int S, struct i8acc *A) {
    const int bb = block_bytes(type);
    __m256 dw = halves8(row, bb, nb < 8 ? nb : 8, 0), m = type == T_Q4_1 ? halves8(row, bb, nb < 8 ? nb : 8, 2) : dw;
    for (int b0 = 0; b0 < nb; b0 += 8) {  /* d and m read one group ahead, as vnni_32 */
        int n = nb - b0 < 8 ? nb - b0 : 8, next = nb - b0 - 8 < 8 ? nb - b0 - 8 : 8;
        const uint8_t *blk = row + (int64_t)b0 * bb;
        __m256 dw_next = dw, m_next = m;
        if (next > 0) {
            dw_next = halves8(blk + 8 * bb, bb, next, 0);
            if (type == T_Q4_1) m_next = halves8(blk + 8 * bb, bb, next, 2);
        }
        float neg_m[8];
        if (type == T_Q4_1) _mm256_storeu_ps(neg_m, _mm256_xor_ps(m, _mm256_set1_ps(-0.0f)));  /* -m, as the reference's */
        if (n == 8)
            avx2_32_group(type, blk, 8, x + b0 / 8, ldx, S, A, dw, neg_m);
        else
            avx2_32_group(type, blk, n, x + b0 / 8, ldx, S, A, dw, neg_m);
        dw = dw_next, m = m_next;
    }
}

static AVX2_TARGET void avx2_row(int type, const uint8_t *row, const void *x, int64_t ldx, int nb, int S, struct i8acc *A) {
    switch (type) {
    case T_Q4_0: avx2_32(T_Q4_0, row, x, ldx, nb, S, A); break;
    case T_Q4_1: avx2_32(T_Q4_1, row, x, ldx, nb, S, A); break;
    case T_Q8_0: avx2_32(T_Q8_0, row, x, ldx, nb, S, A); break;
    case T_Q4_K: avx2_k(T_Q4_K, row, x, ldx, nb, S, A); break;
    case T_Q5_K: avx2_k(T_Q5_K, row, x, ldx, nb, S, A); break;
    case T_Q6_K: avx2_k(T_Q6_K, row, x, ldx, nb, S, A); break;
    }
}

/* -- AVX-512 with VNNI: 64 weights an instruction or two, the weights unpacked into registers.
 *    A super-block's 64 weights per vpmaddubsw and vpdpwssd (its 16 int32 lanes are the
 *    reference's V_l as they stand); two 32-weight blocks per vpdpbusd (lanes 0-7 the even
 *    block, 8-15 the odd one: the reference's lanes again). */

/* vpermw indices: lane m of a 64-weight chunk p takes scale `4p + m / 8` (Q6_K, per 16) or
 * `2p + m / 16` (Q4_K, Q5_K, per 32). */
static INLINE VNNI_TARGET __m512i scale_index(int per16, int p) {
    __m512i m = _mm512_set_epi16(31, 30, 29, 28, 27, 26, 25, 24, 23, 22, 21, 20, 19, 18, 17, 16, 15, 14, 13, 12, 11, 10, 9, 8, 7,
                                 6, 5, 4, 3, 2, 1, 0);
    return per16 ? _mm512_add_epi16(_mm512_set1_epi16((short)(4 * p)), _mm512_srli_epi16(m, 3))
                 : _mm512_add_epi16(_mm512_set1_epi16((short)(2 * p)), _mm512_srli_epi16(m, 4));
}

/* A super-block's 256 weights as unsigned bytes (Q4_K 0..15, Q5_K 0..31, Q6_K 0..63): byte m of
 * q[p] is weight 64p + m. The 8-bit and the 16-bit products (int16_rows.c) both start here. */
static INLINE VNNI_TARGET void vnni_k_bytes(const int type, const uint8_t *blk, __m512i *q) {
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

static INLINE VNNI_TARGET void vnni_k(const int type, const uint8_t *row, const struct block_q8_k *x, int64_t ldx, int nb, int S,
                                      struct i8acc *A) {
    const int bb = block_bytes(type);
    for (int b = 0; b < nb; b++) {
        const uint8_t *blk = row + (int64_t)b * bb;
        __m512i q[4], sc[4], s16;
        __m256i off;
        float d, f;
        vnni_k_bytes(type, blk, q);
        if (type == T_Q6_K) {
            off = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(blk + 192)));
            s16 = _mm512_castsi256_si512(off);
            d = half_at(blk + 208);
            f = 32.0f * d;
        } else {
            uint64_t scb, mnb;
            k4_scales(blk + 4, &scb, &mnb);
            s16 = _mm512_castsi128_si512(_mm_cvtepu8_epi16(_mm_cvtsi64_si128((long long)scb)));
            __m128i mb = _mm_cvtsi64_si128((long long)mnb);
            off = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(mb, mb));
            d = half_at(blk);
            f = half_at(blk + 2);
        }
        for (int p = 0; p < 4; p++) sc[p] = _mm512_permutexvar_epi16(scale_index(type == T_Q6_K, p), s16);
        for (int s = 0; s < S; s++) {
            const struct block_q8_k *xs = x + s * ldx + b;
            __m512i V = _mm512_setzero_si512();
            for (int p = 0; p < 4; p++)
                V = _mm512_dpwssd_epi32(V, _mm512_maddubs_epi16(q[p], _mm512_loadu_si512((const void *)(xs->qs + 64 * p))), sc[p]);
            _mm512_store_ps(A[s].a, _mm512_fmadd_ps(_mm512_cvtepi32_ps(V), _mm512_set1_ps(d * xs->d), _mm512_load_ps(A[s].a)));
            offset_lanes(off, f, xs, &A[s]);
        }
    }
}

/* One group of n (<= 8) blocks against all S rows (g: the rows' activation groups, ldx apart);
 * dw its blocks' d, neg_m Q4_1's -m. Called with n a constant 8 for whole groups, so that the
 * weights stay in registers. */
static INLINE VNNI_TARGET void vnni_32_group(const int type, const uint8_t *blk, const int n, const struct block_q8_32x8 *g,
                                             int64_t ldx, int S, struct i8acc *A, __m256 dw, const float *neg_m) {
    const int bb = block_bytes(type), qoff = type == T_Q4_1 ? 4 : 2, pairs = n / 2;
    __m512i fifteen = _mm512_set1_epi8(15), zero = _mm512_setzero_si512();
    __m512i half = _mm512_srli_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), 3);  /* 0 x8, 1 x8 */
    __m512i W[4];      /* |w| (Q4_1: q), two blocks a register */
    __mmask64 neg[4];  /* w < 0 */
    for (int i = 0; i < pairs; i++) {
        const uint8_t *b = blk + 2 * i * bb;
        __m512i w;
        if (type == T_Q8_0) {
            w = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(b + 2))),
                                   _mm256_loadu_si256((const __m256i *)(b + bb + 2)), 1);
        } else {  /* byte l of a block: weight l in its low nibble, 16 + l in its high */
            __m256i v = _mm256_set_m128i(_mm_loadu_si128((const __m128i *)(b + bb + qoff)), _mm_loadu_si128((const __m128i *)(b + qoff)));
            w = _mm512_inserti64x4(_mm512_castsi256_si512(v), _mm256_srli_epi16(v, 4), 1);        /* lo0 lo1 hi0 hi1 */
            w = _mm512_and_si512(_mm512_shuffle_i64x2(w, w, _MM_SHUFFLE(3, 1, 2, 0)), fifteen);  /* lo0 hi0 lo1 hi1 */
            if (type == T_Q4_0) w = _mm512_sub_epi8(w, _mm512_set1_epi8(8));
        }
        neg[i] = _mm512_movepi8_mask(w);
        W[i] = type == T_Q4_1 ? w : _mm512_abs_epi8(w);
    }
    __m256i wt = _mm256_setzero_si256(), wta = wt;  /* an odd last block: lanes 0-7 alone */
    if (n & 1) {
        const uint8_t *b = blk + (n - 1) * bb;
        if (type == T_Q8_0) {
            wt = _mm256_loadu_si256((const __m256i *)(b + 2));
        } else {
            __m128i v = _mm_loadu_si128((const __m128i *)(b + qoff)), f = _mm_set1_epi8(15);
            wt = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), f), _mm_and_si128(v, f));
            if (type == T_Q4_0) wt = _mm256_sub_epi8(wt, _mm256_set1_epi8(8));
        }
        wta = type == T_Q4_1 ? wt : _mm256_abs_epi8(wt);
    }
    for (int s = 0; s < S; s++, g += ldx) {
        /* pair i (blocks 2i, 2i + 1 of the group) into lanes 16 (i % 2) .. + 15 */
        __m512 a[2] = {_mm512_load_ps(A[s].a), _mm512_load_ps(A[s].a + 16)};
        __m512 dd = _mm512_castps256_ps512(_mm256_mul_ps(dw, _mm256_loadu_ps(g->d)));
        for (int i = 0; i < pairs; i++) {
            __m512i X = _mm512_loadu_si512((const void *)(g->qs + 64 * i));
            if (type != T_Q4_1) X = _mm512_mask_sub_epi8(X, neg[i], zero, X);
            __m512i P = _mm512_dpbusd_epi32(zero, W[i], X);
            __m512 ddi = _mm512_permutexvar_ps(_mm512_add_epi32(half, _mm512_set1_epi32(2 * i)), dd);
            a[i % 2] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(P), ddi, a[i % 2]);
        }
        if (n & 1) {  /* block n - 1: lanes 8 ((n - 1) % 4) .. + 7, the low half of a[pairs % 2] */
            __m256i X = _mm256_loadu_si256((const __m256i *)(g->qs + 32 * (n - 1)));
            if (type != T_Q4_1) X = _mm256_sign_epi8(X, wt);
            __m256i P = _mm256_dpbusd_epi32(_mm256_setzero_si256(), wta, X);
            __m256 ddt = _mm256_permutevar8x32_ps(_mm512_castps512_ps256(dd), _mm256_set1_epi32(n - 1));
            __m512 *at = &a[pairs % 2];
            *at = _mm512_insertf32x8(*at, _mm256_fmadd_ps(_mm256_cvtepi32_ps(P), ddt, _mm512_castps512_ps256(*at)), 0);
        }
        _mm512_store_ps(A[s].a, a[0]);
        _mm512_store_ps(A[s].a + 16, a[1]);
        if (type == T_Q4_1) q4_1_mins(neg_m, g, n, &A[s]);
    }
}

/* halves8 without a gather (slow on AMD's Zen 4): the group's bytes in four masked loads (none
 * past its n blocks), the words picked by two vpermt2w. */
static INLINE VNNI_TARGET __m256 halves8_512(const uint8_t *blk, int bb, int n, int at) {
    int bytes = n * bb;
    __m512i z[4];
    for (int j = 0; j < 4; j++) {
        int left = bytes - 64 * j;
        __mmask64 k = left >= 64 ? ~(__mmask64)0 : left <= 0 ? 0 : (((__mmask64)1 << left) - 1);
        z[j] = _mm512_maskz_loadu_epi8(k, blk + 64 * j);
    }
    __m512i word = _mm512_add_epi16(_mm512_mullo_epi16(_mm512_set_epi16(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
                                                                         0, 0, 0, 7, 6, 5, 4, 3, 2, 1, 0),
                                                        _mm512_set1_epi16((short)(bb / 2))),
                                    _mm512_set1_epi16((short)(at / 2)));
    __m512i lo = _mm512_permutex2var_epi16(z[0], word, z[1]);
    __m512i hi = _mm512_permutex2var_epi16(z[2], _mm512_sub_epi16(word, _mm512_set1_epi16(64)), z[3]);
    __m512i w = _mm512_mask_blend_epi16(_mm512_cmpge_epi16_mask(word, _mm512_set1_epi16(64)), lo, hi);
    return _mm256_cvtph_ps(_mm512_castsi512_si128(w));
}

/* A group's d (and Q4_1's -m) are read one group ahead: their loads' latency then passes under
 * the work of the group before. */
static INLINE VNNI_TARGET void vnni_32(const int type, const uint8_t *row, const struct block_q8_32x8 *x, int64_t ldx, int nb,
                                       int S, struct i8acc *A) {
    const int bb = block_bytes(type);
    __m256 dw = halves8_512(row, bb, nb < 8 ? nb : 8, 0), m = type == T_Q4_1 ? halves8_512(row, bb, nb < 8 ? nb : 8, 2) : dw;
    for (int b0 = 0; b0 < nb; b0 += 8) {
        int n = nb - b0 < 8 ? nb - b0 : 8, next = nb - b0 - 8 < 8 ? nb - b0 - 8 : 8;
        const uint8_t *blk = row + (int64_t)b0 * bb;
        __m256 dw_next = dw, m_next = m;
        if (next > 0) {
            dw_next = halves8_512(blk + 8 * bb, bb, next, 0);
            if (type == T_Q4_1) m_next = halves8_512(blk + 8 * bb, bb, next, 2);
        }
        float neg_m[8];
        if (type == T_Q4_1) _mm256_storeu_ps(neg_m, _mm256_xor_ps(m, _mm256_set1_ps(-0.0f)));  /* -m, as the reference's */
        if (n == 8)
            vnni_32_group(type, blk, 8, x + b0 / 8, ldx, S, A, dw, neg_m);
        else
            vnni_32_group(type, blk, n, x + b0 / 8, ldx, S, A, dw, neg_m);
        dw = dw_next, m = m_next;
    }
}

static VNNI_TARGET void vnni_row(int type, const uint8_t *row, const void *x, int64_t ldx, int nb, int S, struct i8acc *A) {
    switch (type) {
    case T_Q4_0: vnni_32(T_Q4_0, row, x, ldx, nb, S, A); break;
    case T_Q4_1: vnni_32(T_Q4_1, row, x, ldx, nb, S, A); break;
    case T_Q8_0: vnni_32(T_Q8_0, row, x, ldx, nb, S, A); break;
    case T_Q4_K: vnni_k(T_Q4_K, row, x, ldx, nb, S, A); break;
    case T_Q5_K: vnni_k(T_Q5_K, row, x, ldx, nb, S, A); break;
    case T_Q6_K: vnni_k(T_Q6_K, row, x, ldx, nb, S, A); break;
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

/* ---- products ------------------------------------------------------------------------------ */

/* Outputs [r0, r1) of one part (an int8 type) against all S rows: y[s * ldy + r]. */
static void int8_outputs(const struct part *p, int64_t r0, int64_t r1, const struct block_q8_32x8 *x32, const struct block_q8_k *xk,
                         int S, int K, float *y, int64_t ldy, int path) {
    int k = is_k_type(p->type), nb = K / block_weights(p->type);
    int64_t ldx = act_blocks(K, k ? Q8_K : Q8_32);
    struct i8acc A[I8_ROWS];
    for (int64_t r = r0; r < r1; r++) {
        const uint8_t *row = (const uint8_t *)p->data + r * p->ld;
        if (r + PREFETCH_ROWS < p->rows)
            for (int64_t b = 0; b < p->ld; b += 64) __builtin_prefetch(row + PREFETCH_ROWS * p->ld + b, 0, 3);
        for (int s0 = 0; s0 < S; s0 += I8_ROWS) {
            int g = S - s0 < I8_ROWS ? S - s0 : I8_ROWS;
            const void *xs = k ? (const void *)(xk + s0 * ldx) : (const void *)(x32 + s0 * ldx);
            memset(A, 0, sizeof(A[0]) * (size_t)g);
            switch (path) {
#ifdef I8_X86
            case INT8_AVX512_VNNI: vnni_row(p->type, row, xs, ldx, nb, g, A); break;
            case INT8_AVX2: avx2_row(p->type, row, xs, ldx, nb, g, A); break;
#endif
            default: ref_row(p->type, row, xs, ldx, nb, g, A); break;
            }
            for (int s = 0; s < g; s++) y[(int64_t)(s0 + s) * ldy + r] = i8_result(&A[s]);
        }
    }
}
