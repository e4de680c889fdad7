/* Matrix products over weights kept as GGUF files store them: blocks of small integers with
 * 16-bit scales (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K), or plain float32/float16 rows.
 *
 * Included by layers.c (one library). A matrix is one or more `part`s stacked by output row,
 * each [outputs, inputs] with the blocks running along the inputs, as llama.cpp writes them:
 * the q, k and v projections of a Q4_K_M file are often of two types and run as one product.
 *
 * Exactness. A weight is dequantized with the arithmetic of ggml's reference (and of the gguf
 * package's, which transformers uses): every product of a scale and a small integer is exact
 * in float32 except Q6_K's, rounded once in the same order; so a weight here equals, bit for
 * bit, the one Hugging Face's model holds after loading the file. The sums then run in float32
 * with one fixed order per output: lane l of LANES accumulates the inputs k = l (mod LANES) in
 * increasing k, one FMA each, and the lanes are added by one fixed tree. The order depends on
 * nothing but the input index, so a row's result is the same bit for bit whatever rows share
 * its call (a verification's logits equal a step's) and whatever thread computes it.
 *
 * Why floats and not llama.cpp's integer dot products: those quantize the activations to 8
 * bits as well, which changes the model (its greedy output is not Hugging Face's).
 */
#include <stdint.h>

enum {
    T_F32 = 0, T_F16 = 1, T_Q4_0 = 2, T_Q4_1 = 3, T_Q5_0 = 6, T_Q5_1 = 7, T_Q8_0 = 8, T_Q4_K = 12, T_Q5_K = 13, T_Q6_K = 14,
    T_F32_IN_OUT = 255, /* layers.c's float32 weights, stored [inputs, outputs] */
};

struct part {
    const void *data;
    int64_t ld;   /* bytes from one output row to the next (T_F32_IN_OUT: floats between input rows) */
    int32_t type;
    int32_t rows; /* outputs */
};

#define LANES 16 /* inputs a step of the sums covers: two 8-float vectors */
#define OUT_JOB 16 /* outputs a thread's job computes */

static inline float half_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
    if (exp == 0x1f) {
        bits = sign | 0x7f800000u | (man << 13);
    } else if (exp) {
        bits = sign | ((exp + 112) << 23) | (man << 13);
    } else if (man) { /* subnormal: normalise */
        int e = -1;
        do { man <<= 1; e++; } while (!(man & 0x400));
        bits = sign | ((uint32_t)(112 - e) << 23) | ((man & 0x3ff) << 13);
    } else {
        bits = sign;
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static inline float half_at(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
#ifdef __F16C__
    return _cvtsh_ss(h); /* one instruction, the same value */
#else
    return half_to_float(h);
#endif
}

static int block_weights(int type) {
    switch (type) {
    case T_Q4_0: case T_Q4_1: case T_Q5_0: case T_Q5_1: case T_Q8_0: return 32;
    case T_Q4_K: case T_Q5_K: case T_Q6_K: return 256;
    default: return 1;
    }
}

static int block_bytes(int type) {
    switch (type) {
    case T_F32: return 4;
    case T_F16: return 2;
    case T_Q4_0: return 18;
    case T_Q4_1: return 20;
    case T_Q5_0: return 22;
    case T_Q5_1: return 24;
    case T_Q8_0: return 34;
    case T_Q4_K: return 144;
    case T_Q5_K: return 176;
    case T_Q6_K: return 210;
    default: return 0;
    }
}

/* The 6-bit scale and minimum of sub-block j of a Q4_K/Q5_K super-block (12 packed bytes). */
static inline void scale_min_k4(int j, const uint8_t *q, int *sc, int *m) {
    if (j < 4) {
        *sc = q[j] & 63;
        *m = q[j + 4] & 63;
    } else {
        *sc = (q[j + 4] & 0xf) | ((q[j - 4] >> 6) << 4);
        *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

/* Q5_0 and Q5_1 (32 weights): Q4_0's and Q4_1's nibbles (weight i the low nibble of qs[i],
 * weight 16 + i its high one) with a fifth bit each, bit i of the 32-bit word qh, stored
 * little-endian as ggml writes it (and as the gguf package reads it). Q5_0: d (q - 16); Q5_1:
 * d q + m, where d q is exact (11 bits of d times 5), so one rounding as Q4_1's. */
static inline uint32_t q5_high_bits(const uint8_t *qh) {
    return (uint32_t)qh[0] | (uint32_t)qh[1] << 8 | (uint32_t)qh[2] << 16 | (uint32_t)qh[3] << 24;
}

#ifdef HAVE_AVX2
/* 8 bytes -> 8 floats (signed or unsigned) */
static inline __m256 bytes_u8(__m128i b) { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(b)); }
static inline __m256 bytes_i8(__m128i b) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)); }

/* The 16 low nibbles (weights 0..15) and 16 high nibbles (16..31) of a 32-weight block. */
static inline void nibbles(const uint8_t *qs, __m128i *lo, __m128i *hi) {
    __m128i q = _mm_loadu_si128((const __m128i *)qs), mask = _mm_set1_epi8(15);
    *lo = _mm_and_si128(q, mask);
    *hi = _mm_and_si128(_mm_srli_epi16(q, 4), mask);
}

static void dequant_q4_0(const uint8_t *b, float *w) {
    __m256 d = _mm256_set1_ps(half_at(b));
    __m128i lo, hi, eight = _mm_set1_epi8(8);
    nibbles(b + 2, &lo, &hi);
    lo = _mm_sub_epi8(lo, eight), hi = _mm_sub_epi8(hi, eight);
    _mm256_storeu_ps(w, _mm256_mul_ps(d, bytes_i8(lo)));
    _mm256_storeu_ps(w + 8, _mm256_mul_ps(d, bytes_i8(_mm_srli_si128(lo, 8))));
    _mm256_storeu_ps(w + 16, _mm256_mul_ps(d, bytes_i8(hi)));
    _mm256_storeu_ps(w + 24, _mm256_mul_ps(d, bytes_i8(_mm_srli_si128(hi, 8))));
}

static void dequant_q4_1(const uint8_t *b, float *w) {
    __m256 d = _mm256_set1_ps(half_at(b)), m = _mm256_set1_ps(half_at(b + 2));
    __m128i lo, hi;
    nibbles(b + 4, &lo, &hi);
    _mm256_storeu_ps(w, _mm256_add_ps(_mm256_mul_ps(d, bytes_u8(lo)), m));
    _mm256_storeu_ps(w + 8, _mm256_add_ps(_mm256_mul_ps(d, bytes_u8(_mm_srli_si128(lo, 8))), m));
    _mm256_storeu_ps(w + 16, _mm256_add_ps(_mm256_mul_ps(d, bytes_u8(hi)), m));
    _mm256_storeu_ps(w + 24, _mm256_add_ps(_mm256_mul_ps(d, bytes_u8(_mm_srli_si128(hi, 8))), m));
}

/* Weights 8i .. 8i + 7's fifth bits (i = 0..3) as 16 or 0. */
static inline __m256i q5_high(uint32_t qh, int i) {
    const __m256i bit = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
    __m256i h = _mm256_set1_epi32((int)(qh >> (8 * i)));
    return _mm256_and_si256(_mm256_cmpeq_epi32(_mm256_and_si256(h, bit), bit), _mm256_set1_epi32(16));
}

/* A Q5_0/Q5_1 block's 32 unsigned 5-bit values, weights 8i .. 8i + 7 in n[i]. */
static inline void q5_values(const uint8_t *qs, uint32_t qh, __m256i n[4]) {
    __m256i v0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)qs));
    __m256i v1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(qs + 8))), mask = _mm256_set1_epi32(15);
    n[0] = _mm256_and_si256(v0, mask), n[1] = _mm256_and_si256(v1, mask);
    n[2] = _mm256_srli_epi32(v0, 4), n[3] = _mm256_srli_epi32(v1, 4);
    for (int i = 0; i < 4; i++) n[i] = _mm256_or_si256(n[i], q5_high(qh, i));
}

static void dequant_q5_0(const uint8_t *b, float *w) {
    __m256 d = _mm256_set1_ps(half_at(b));
    __m256i n[4], sixteen = _mm256_set1_epi32(16);
    q5_values(b + 6, q5_high_bits(b + 2), n);
    for (int i = 0; i < 4; i++) _mm256_storeu_ps(w + 8 * i, _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_sub_epi32(n[i], sixteen))));
}

static void dequant_q5_1(const uint8_t *b, float *w) {
    __m256 d = _mm256_set1_ps(half_at(b)), m = _mm256_set1_ps(half_at(b + 2));
    __m256i n[4];
    q5_values(b + 8, q5_high_bits(b + 4), n);
    for (int i = 0; i < 4; i++) _mm256_storeu_ps(w + 8 * i, _mm256_add_ps(_mm256_mul_ps(d, _mm256_cvtepi32_ps(n[i])), m));
}

static void dequant_q8_0(const uint8_t *b, float *w) {
    __m256 d = _mm256_set1_ps(half_at(b));
    for (int i = 0; i < 32; i += 8)
        _mm256_storeu_ps(w + i, _mm256_mul_ps(d, bytes_i8(_mm_loadl_epi64((const __m128i *)(b + 2 + i)))));
}
#else
static void dequant_q4_0(const uint8_t *b, float *w) {
    float d = half_at(b);
    const uint8_t *qs = b + 2;
    for (int i = 0; i < 16; i++) {
        w[i] = d * (float)((int)(qs[i] & 15) - 8);
        w[i + 16] = d * (float)((int)(qs[i] >> 4) - 8);
    }
}

static void dequant_q4_1(const uint8_t *b, float *w) {
    float d = half_at(b), m = half_at(b + 2);
    const uint8_t *qs = b + 4;
    for (int i = 0; i < 16; i++) {
        w[i] = d * (float)(qs[i] & 15) + m;
        w[i + 16] = d * (float)(qs[i] >> 4) + m;
    }
}

static void dequant_q5_0(const uint8_t *b, float *w) {
    float d = half_at(b);
    uint32_t qh = q5_high_bits(b + 2);
    const uint8_t *qs = b + 6;
    for (int i = 0; i < 16; i++) {
        w[i] = d * (float)((int)((qs[i] & 15) | ((qh >> i) & 1) << 4) - 16);
        w[i + 16] = d * (float)((int)((qs[i] >> 4) | ((qh >> (i + 16)) & 1) << 4) - 16);
    }
}

static void dequant_q5_1(const uint8_t *b, float *w) {
    float d = half_at(b), m = half_at(b + 2);
    uint32_t qh = q5_high_bits(b + 4);
    const uint8_t *qs = b + 8;
    for (int i = 0; i < 16; i++) {
        w[i] = d * (float)((qs[i] & 15) | ((qh >> i) & 1) << 4) + m;
        w[i + 16] = d * (float)((qs[i] >> 4) | ((qh >> (i + 16)) & 1) << 4) + m;
    }
}

static void dequant_q8_0(const uint8_t *b, float *w) {
    float d = half_at(b);
    const int8_t *qs = (const int8_t *)(b + 2);
    for (int i = 0; i < 32; i++) w[i] = d * (float)qs[i];
}
#endif

/* Q4_K and Q5_K: eight sub-blocks of 32 with 6-bit scales and minimums; Q5_K adds a fifth bit
 * per weight from qh (bit j of qh[l] for sub-block j). ds * v is exact (at most 22 bits), so
 * the vector path's fused multiply-subtract rounds once, as the scalar `ds * v - dm` does. */
static void dequant_k4(const uint8_t *b, float *w, const uint8_t *qh, const uint8_t *qs) {
    float d = half_at(b), dmin = half_at(b + 2);
    const uint8_t *scales = b + 4;
    for (int j = 0; j < 8; j++) {
        int sc, m;
        scale_min_k4(j, scales, &sc, &m);
        float ds = d * (float)sc, dm = dmin * (float)m;
        const uint8_t *q = qs + (j / 2) * 32;
        int shift = (j % 2) * 4;
#ifdef HAVE_AVX2
        __m256 vds = _mm256_set1_ps(ds), vdm = _mm256_set1_ps(dm);
        __m256i fifteen = _mm256_set1_epi32(15), one = _mm256_set1_epi32(1);
        for (int l = 0; l < 32; l += 8) {
            __m256i v = _mm256_and_si256(_mm256_srli_epi32(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(q + l))), shift),
                                         fifteen);
            if (qh) {
                __m256i h = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(qh + l)));
                v = _mm256_or_si256(v, _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(h, j), one), 4));
            }
            _mm256_storeu_ps(w + j * 32 + l, _mm256_fmsub_ps(vds, _mm256_cvtepi32_ps(v), vdm));
        }
#else
        for (int l = 0; l < 32; l++) {
            int v = (q[l] >> shift) & 15;
            if (qh) v |= ((qh[l] >> j) & 1) << 4;
            w[j * 32 + l] = ds * (float)v - dm;
        }
#endif
    }
}

static void dequant_q4_k(const uint8_t *b, float *w) { dequant_k4(b, w, NULL, b + 16); }
static void dequant_q5_k(const uint8_t *b, float *w) { dequant_k4(b, w, b + 16, b + 48); }

/* Weight h*128 + c*32 + l takes the low (c < 2) or high nibble of ql[h*64 + (c&1)*32 + l] and
 * bits 2c, 2c+1 of qh[h*32 + l]; scale (d * scales[i]) for weights 16i..16i+15. */
static void dequant_q6_k(const uint8_t *b, float *w) {
    const uint8_t *ql = b, *qh = b + 128;
    const int8_t *scales = (const int8_t *)(b + 192);
    float d = half_at(b + 208), ds[16];
    for (int i = 0; i < 16; i++) ds[i] = d * (float)scales[i];
#ifdef HAVE_AVX2
    __m256i fifteen = _mm256_set1_epi32(15), three = _mm256_set1_epi32(3), bias = _mm256_set1_epi32(32);
    for (int h = 0; h < 2; h++)
        for (int c = 0; c < 4; c++)
            for (int l = 0; l < 32; l += 8) {
                __m256i lo = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(ql + h * 64 + (c & 1) * 32 + l)));
                __m256i hb = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(qh + h * 32 + l)));
                lo = c < 2 ? _mm256_and_si256(lo, fifteen) : _mm256_srli_epi32(lo, 4);
                hb = _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(hb, 2 * c), three), 4);
                __m256 v = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_or_si256(lo, hb), bias));
                _mm256_storeu_ps(w + h * 128 + c * 32 + l, _mm256_mul_ps(_mm256_set1_ps(ds[h * 8 + c * 2 + l / 16]), v));
            }
#else
    for (int h = 0; h < 2; h++)
        for (int half = 0; half < 32; half += 16) {
            const uint8_t *lo = ql + h * 64 + half, *hb = qh + h * 32 + half;
            const float *sc = ds + h * 8 + half / 16;
            float *wh = w + h * 128 + half;
            for (int l = 0; l < 16; l++) {
                wh[l] = sc[0] * (float)(((lo[l] & 15) | ((hb[l] & 3) << 4)) - 32);
                wh[l + 32] = sc[2] * (float)(((lo[l + 32] & 15) | (((hb[l] >> 2) & 3) << 4)) - 32);
                wh[l + 64] = sc[4] * (float)(((lo[l] >> 4) | (((hb[l] >> 4) & 3) << 4)) - 32);
                wh[l + 96] = sc[6] * (float)(((lo[l + 32] >> 4) | (((hb[l] >> 6) & 3) << 4)) - 32);
            }
        }
#endif
}

/* Row r of a part, all K inputs, as float32. */
static void dequant_row(const struct part *p, int64_t r, int K, float *w) {
    const uint8_t *row = (const uint8_t *)p->data + r * p->ld;
    int bw = block_weights(p->type), bb = block_bytes(p->type);
    switch (p->type) {
    case T_F32: memcpy(w, row, sizeof(float) * (size_t)K); return;
    case T_F16: for (int k = 0; k < K; k++) w[k] = half_at(row + 2 * k); return;
    default: break;
    }
    for (int k = 0; k < K; k += bw, row += bb) {
        switch (p->type) {
        case T_Q4_0: dequant_q4_0(row, w + k); break;
        case T_Q4_1: dequant_q4_1(row, w + k); break;
        case T_Q5_0: dequant_q5_0(row, w + k); break;
        case T_Q5_1: dequant_q5_1(row, w + k); break;
        case T_Q8_0: dequant_q8_0(row, w + k); break;
        case T_Q4_K: dequant_q4_k(row, w + k); break;
        case T_Q5_K: dequant_q5_k(row, w + k); break;
        case T_Q6_K: dequant_q6_k(row, w + k); break;
        }
    }
}

/* The vector paths: AVX2, and where the compiler targets AVX-512 (-march=native on such a
 * machine; TRIFORCE_NO_AVX512 builds without it) 16-lane versions of the same sums, equal bit
 * for bit (tested by building both). */
#if defined(HAVE_AVX2) && defined(__AVX512F__) && defined(__AVX512DQ__) && !defined(TRIFORCE_NO_AVX512)
#define USE_AVX512 1
#endif
/* Weights are prefetched this many rows ahead, into the level-1 cache: the hardware's own
 * prefetcher left a one-row pass over a Q8_0 vocabulary waiting on memory, and a non-temporal
 * hint did not help. */
#define PREFETCH_ROWS 2 /* outside the vector paths: the integer products use it on every machine */

#if defined(HAVE_AVX2)
static inline float lanes_sum8(__m256 v) {
    __m128 b = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    b = _mm_add_ps(b, _mm_movehl_ps(b, b));
    b = _mm_add_ss(b, _mm_movehdup_ps(b));
    return _mm_cvtss_f32(b);
}

/* y[s] = sum_k w[k] x[s][k] for the g rows x[0..g), K a multiple of LANES: accumulator 0 takes
 * the inputs k = 0..7 (mod 16), accumulator 1 the inputs 8..15, each in increasing k. */
#ifdef USE_AVX512
/* The AVX-512 path: one 16-lane register holds what the two 8-lane accumulators hold (lanes
 * 0-7 take k = 0..7 mod 16, lanes 8-15 k = 8..15, each in increasing k, one FMA each), and its
 * halves are added before the same tree: every result equals the AVX2 path's bit for bit. */
static inline float lanes_sum16(__m512 v) {
    return lanes_sum8(_mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1)));
}

static void dot_rows(const float *w, const float *x, int64_t ldx, int g, int K, float *y, int64_t ldy) {
    for (int s = 0; s < g; s++) {
        const float *xs = x + s * ldx;
        __m512 a = _mm512_setzero_ps();
        for (int k = 0; k < K; k += LANES) a = _mm512_fmadd_ps(_mm512_loadu_ps(w + k), _mm512_loadu_ps(xs + k), a);
        y[s * ldy] = lanes_sum16(a);
    }
}
#else
static void dot_rows(const float *w, const float *x, int64_t ldx, int g, int K, float *y, int64_t ldy) {
    for (int s = 0; s < g; s++) {
        const float *xs = x + s * ldx;
        __m256 a0 = _mm256_setzero_ps(), a1 = a0;
        for (int k = 0; k < K; k += LANES) {
            a0 = _mm256_fmadd_ps(_mm256_loadu_ps(w + k), _mm256_loadu_ps(xs + k), a0);
            a1 = _mm256_fmadd_ps(_mm256_loadu_ps(w + k + 8), _mm256_loadu_ps(xs + k + 8), a1);
        }
        y[s * ldy] = lanes_sum8(_mm256_add_ps(a0, a1));
    }
}
#endif

/* Q4_1's (and Q5_1's) scale and minimum, two halves side by side, converted by one instruction: [d, m, 0, 0]. */
static inline __m128 half_pair(const uint8_t *b) {
#ifdef __F16C__
    int32_t pair;
    memcpy(&pair, b, 4);
    return _mm_cvtph_ps(_mm_cvtsi32_si128(pair));
#else
    return _mm_setr_ps(half_at(b), half_at(b + 2), 0.0f, 0.0f);
#endif
}

/* The 32-weight block types dequantized straight into four registers (weights 0-7, 8-15,
 * 16-23, 24-31), the same values as dequant_row's. */
static inline __attribute__((always_inline)) void block32(const int type, const uint8_t *b, __m256 w[4]) {
    if (type == T_Q8_0) {
        __m256 d = _mm256_set1_ps(half_at(b));
        for (int i = 0; i < 4; i++)
            w[i] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(b + 2 + 8 * i)))));
        return;
    }
    if (type == T_Q5_0 || type == T_Q5_1) {
        __m256i n[4];
        q5_values(b + (type == T_Q5_1 ? 8 : 6), q5_high_bits(b + (type == T_Q5_1 ? 4 : 2)), n);
        if (type == T_Q5_0) {
            __m256 d = _mm256_set1_ps(half_at(b));
            __m256i sixteen = _mm256_set1_epi32(16);
            for (int i = 0; i < 4; i++) w[i] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_sub_epi32(n[i], sixteen)));
        } else {
            __m128 dm = half_pair(b);
            __m256 d = _mm256_broadcastss_ps(dm), m = _mm256_broadcastss_ps(_mm_movehdup_ps(dm));
            for (int i = 0; i < 4; i++) w[i] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(n[i]), m);
        }
        return;
    }
    const uint8_t *qs = b + (type == T_Q4_1 ? 4 : 2);
    /* each 8 bytes widened straight from memory: weights 0-7 and 16-23 from bytes 0-7 */
    __m256i v0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)qs));
    __m256i v1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(qs + 8))), mask = _mm256_set1_epi32(15);
    __m256i n[4] = {_mm256_and_si256(v0, mask), _mm256_and_si256(v1, mask), _mm256_srli_epi32(v0, 4), _mm256_srli_epi32(v1, 4)};
    if (type == T_Q4_0) {
        __m256 d = _mm256_set1_ps(half_at(b));
        __m256i eight = _mm256_set1_epi32(8);
        for (int i = 0; i < 4; i++) w[i] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_sub_epi32(n[i], eight)));
    } else {
        __m128 dm = half_pair(b);
        __m256 d = _mm256_broadcastss_ps(dm), m = _mm256_broadcastss_ps(_mm_movehdup_ps(dm));
        for (int i = 0; i < 4; i++) w[i] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(n[i]), m);
    }
}

#ifdef USE_AVX512
/* block32 in two 16-lane registers (weights 0-15, 16-31): the same values. */
static inline __attribute__((always_inline)) void block32_512(const int type, const uint8_t *b, __m512 w[2]) {
    if (type == T_Q8_0) {
        __m512 d = _mm512_set1_ps(half_at(b));
        for (int i = 0; i < 2; i++)
            w[i] = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(b + 2 + 16 * i)))));
        return;
    }
    if (type == T_Q5_0 || type == T_Q5_1) {
        /* Q4_0's and Q4_1's tables over 5 bits: the 32 values a q can stand for in two
           registers (Q5_0: d (q - 16); Q5_1: d q + m, one rounding), and vpermt2ps picks by
           an index's low 5 bits: the nibble (the low one masked, its byte's bit 4 being the
           high nibble's) with bit 4 set where qh has the weight's bit (a mask register: bits
           0-15 of qh for weights 0-15, 16-31 for 16-31). The same values as computing each. */
        uint32_t qh = q5_high_bits(b + (type == T_Q5_1 ? 4 : 2));
        __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(b + (type == T_Q5_1 ? 8 : 6))));
        __m512 lo, hi;
        if (type == T_Q5_0) {
            __m512 d = _mm512_set1_ps(half_at(b));
            lo = _mm512_mul_ps(d, _mm512_setr_ps(-16, -15, -14, -13, -12, -11, -10, -9, -8, -7, -6, -5, -4, -3, -2, -1));
            hi = _mm512_mul_ps(d, _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
        } else {
            __m512 dm = _mm512_cvtph_ps(_mm256_castps_si256(_mm256_broadcast_ss((const float *)b)));
            __m512 d = _mm512_moveldup_ps(dm), m = _mm512_movehdup_ps(dm);
            lo = _mm512_fmadd_ps(d, _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), m);
            hi = _mm512_fmadd_ps(d, _mm512_setr_ps(16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31), m);
        }
        __m512i sixteen = _mm512_set1_epi32(16), low = _mm512_and_si512(v, _mm512_set1_epi32(15)), high = _mm512_srli_epi32(v, 4);
        w[0] = _mm512_permutex2var_ps(lo, _mm512_mask_or_epi32(low, (__mmask16)(qh & 0xffff), low, sixteen), hi);
        w[1] = _mm512_permutex2var_ps(lo, _mm512_mask_or_epi32(high, (__mmask16)(qh >> 16), high, sixteen), hi);
        return;
    }
    /* byte i holds weight i (low nibble) and weight 16 + i (high nibble). The 16 values a
       nibble n can stand for (Q4_0: d (n - 8); Q4_1: d n + m, one rounding) fill one register,
       and each weight is a permute of it by its nibble: vpermps reads an index's low 4 bits
       only, so the low nibbles need no mask. The same operations on the same numbers as
       computing each weight: the same values. Q4_1's (d, m) are broadcast as loaded and
       converted together (faster than apart). */
    __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(b + (type == T_Q4_1 ? 4 : 2))));
    __m512 table;
    if (type == T_Q4_0) {
        table = _mm512_mul_ps(_mm512_set1_ps(half_at(b)),
                              _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7));
    } else {
        /* the pair (d, m) broadcast as it is loaded, then converted: d, m, d, m, ... */
        __m512 dm = _mm512_cvtph_ps(_mm256_castps_si256(_mm256_broadcast_ss((const float *)b)));
        table = _mm512_fmadd_ps(_mm512_moveldup_ps(dm), _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                _mm512_movehdup_ps(dm));
    }
    w[0] = _mm512_permutexvar_ps(v, table);
    w[1] = _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), table);
}
#endif

/* Rows sharing each dequantized block (2 accumulators a row; past 6 rows some spill to the
 * level-1 cache, still cheaper than dequantizing twice). */
#ifdef USE_AVX512
#define FUSED_ROWS 16 /* one 16-lane accumulator a row: 16 of the 32 registers */
#define FUSED_OUTS 8
#else
#define FUSED_ROWS 8
#define FUSED_OUTS 4 /* outputs a one-row product computes side by side: 8 accumulators */
#endif

/* dot_rows over a row of 32-weight blocks read in place: no float copy of the row. The sums
 * are dot_rows' own, FMA for FMA. */
#ifdef USE_AVX512
static inline __attribute__((always_inline)) void q32_float_rows(const int type, const uint8_t *row, const float *x, int64_t ldx,
                                                              const int G, int K, float *y, int64_t ldy) {
    const int bb = block_bytes(type);
    __m512 a[FUSED_ROWS];
    for (int s = 0; s < G; s++) a[s] = _mm512_setzero_ps();
    for (int k = 0; k < K; k += 2 * LANES, row += bb) {
        __m512 w[2];
        block32_512(type, row, w);
        for (int i = 0; i < 2; i++)
            for (int s = 0; s < G; s++) a[s] = _mm512_fmadd_ps(w[i], _mm512_loadu_ps(x + s * ldx + k + 16 * i), a[s]);
    }
    for (int s = 0; s < G; s++) y[s * ldy] = lanes_sum16(a[s]);
}

static inline __attribute__((always_inline)) void q32_float_outs(const int type, const uint8_t *row, int64_t ldw, const float *x,
                                                              const int O, int K, float *y) {
    const int bb = block_bytes(type);
    __m512 a[FUSED_OUTS];
    for (int o = 0; o < O; o++) a[o] = _mm512_setzero_ps();
    for (int k = 0; k < K; k += 2 * LANES, row += bb)
        for (int o = 0; o < O; o++) {
            __m512 w[2];
            __builtin_prefetch(row + (o + O) * ldw, 0, 3);
            block32_512(type, row + o * ldw, w);
            for (int i = 0; i < 2; i++) a[o] = _mm512_fmadd_ps(w[i], _mm512_loadu_ps(x + k + 16 * i), a[o]);
        }
    for (int o = 0; o < O; o++) y[o] = lanes_sum16(a[o]);
}
#else
static inline __attribute__((always_inline)) void q32_float_rows(const int type, const uint8_t *row, const float *x, int64_t ldx,
                                                              const int G, int K, float *y, int64_t ldy) {
    const int bb = block_bytes(type);
    __m256 a[FUSED_ROWS][2];
    for (int s = 0; s < G; s++) a[s][0] = a[s][1] = _mm256_setzero_ps();
    for (int k = 0; k < K; k += 2 * LANES, row += bb) {
        __m256 w[4];
        block32(type, row, w);
        for (int i = 0; i < 4; i++)
            for (int s = 0; s < G; s++) a[s][i & 1] = _mm256_fmadd_ps(w[i], _mm256_loadu_ps(x + s * ldx + k + 8 * i), a[s][i & 1]);
    }
    for (int s = 0; s < G; s++) y[s * ldy] = lanes_sum8(_mm256_add_ps(a[s][0], a[s][1]));
}

/* One row of x against `O` weight rows (ldw bytes apart) read in place: a step's product. Each
 * output's two accumulators take the same FMAs in the same order as q32_float_rows's (bit for
 * bit its result); the O outputs' chains run side by side, where one output alone waits on
 * its two chains' latency (2 FMAs a block each) and the machine's FMA units stand idle. */
static inline __attribute__((always_inline)) void q32_float_outs(const int type, const uint8_t *row, int64_t ldw, const float *x,
                                                              const int O, int K, float *y) {
    const int bb = block_bytes(type);
    __m256 a[FUSED_OUTS][2];
    for (int o = 0; o < O; o++) a[o][0] = a[o][1] = _mm256_setzero_ps();
    for (int k = 0; k < K; k += 2 * LANES, row += bb)
        for (int o = 0; o < O; o++) {
            __m256 w[4];
            __builtin_prefetch(row + (o + O) * ldw, 0, 3);  /* the next outputs' rows, as far ahead */
            block32(type, row + o * ldw, w);
            for (int i = 0; i < 4; i++) a[o][i & 1] = _mm256_fmadd_ps(w[i], _mm256_loadu_ps(x + k + 8 * i), a[o][i & 1]);
        }
    for (int o = 0; o < O; o++) y[o] = lanes_sum8(_mm256_add_ps(a[o][0], a[o][1]));
}
#endif

/* Outputs [r0, r1) of one part for one row of x: FUSED_OUTS at a time, then the rest. */
#define FUSED_OUTS_RUN(T)                                                                  \
    {                                                                                      \
        int64_t r = r0;                                                                    \
        for (; r + FUSED_OUTS <= r1; r += FUSED_OUTS)                                      \
            q32_float_outs(T, base + r * ldw, ldw, x, FUSED_OUTS, K, y + r);                 \
        for (; r < r1; r++) q32_float_outs(T, base + r * ldw, ldw, x, 1, K, y + r);          \
        return 1;                                                                          \
    }

static int fused_outs(int type, const uint8_t *base, int64_t ldw, int64_t r0, int64_t r1, const float *x, int K, float *y) {
    switch (type) {
    case T_Q4_0: FUSED_OUTS_RUN(T_Q4_0)
    case T_Q4_1: FUSED_OUTS_RUN(T_Q4_1)
    case T_Q5_0: FUSED_OUTS_RUN(T_Q5_0)
    case T_Q5_1: FUSED_OUTS_RUN(T_Q5_1)
    case T_Q8_0: FUSED_OUTS_RUN(T_Q8_0)
    default: return 0;
    }
}

/* S rows in groups of at most FUSED_ROWS, as even as possible (5 rows: one group, not 4 + 1,
 * which would dequantize every block twice for the one row). */
#define FUSED_CASE(T, n) case n: q32_float_rows(T, row, x + s * ldx, ldx, n, K, y + s * ldy, ldy); break;
#if FUSED_ROWS > 8
#define FUSED_CASES_WIDE(T) FUSED_CASE(T, 8) FUSED_CASE(T, 9) FUSED_CASE(T, 10) FUSED_CASE(T, 11) FUSED_CASE(T, 12) \
    FUSED_CASE(T, 13) FUSED_CASE(T, 14) FUSED_CASE(T, 15)
#else
#define FUSED_CASES_WIDE(T)
#endif
#define FUSED_GROUPS(T)                                                                     \
    for (int s = 0, left = (S + FUSED_ROWS - 1) / FUSED_ROWS; s < S; left--) {              \
        int g = (S - s + left - 1) / left;                                                  \
        switch (g) {                                                                        \
        FUSED_CASE(T, 1) FUSED_CASE(T, 2) FUSED_CASE(T, 3) FUSED_CASE(T, 4)                 \
        FUSED_CASE(T, 5) FUSED_CASE(T, 6) FUSED_CASE(T, 7) FUSED_CASES_WIDE(T)              \
        default: q32_float_rows(T, row, x + s * ldx, ldx, FUSED_ROWS, K, y + s * ldy, ldy); break; \
        }                                                                                   \
        s += g;                                                                             \
    }                                                                                       \
    return 1;

/* The 256-weight types (Q4_K, Q5_K, Q6_K: the bulk of a Q4_K_M file) read in place too. A
 * super-block's scales are unpacked once (as dequant_k4 and dequant_q6_k do), then its 32
 * vectors of 8 weights are made in increasing k, each the same values as the row buffer's, and
 * multiplied into the same accumulators as dot_rows (vector i into accumulator i & 1): every
 * sum is dot_rows', FMA for FMA (about twice as fast as dequantizing into a row buffer). */
typedef struct { float ds[16], dm[8]; const uint8_t *lo, *hi; } KScales;

static inline __attribute__((always_inline)) void k_scales(const int type, const uint8_t *b, KScales *ks) {
    if (type == T_Q6_K) {
        float d = half_at(b + 208);
        const int8_t *sc = (const int8_t *)(b + 192);
        for (int i = 0; i < 16; i++) ks->ds[i] = d * (float)sc[i];
        ks->lo = b, ks->hi = b + 128;
        return;
    }
    float d = half_at(b), dmin = half_at(b + 2);
    for (int j = 0; j < 8; j++) {
        int sc, m;
        scale_min_k4(j, b + 4, &sc, &m);
        ks->ds[j] = d * (float)sc, ks->dm[j] = dmin * (float)m;
    }
    ks->lo = b + (type == T_Q5_K ? 48 : 16), ks->hi = type == T_Q5_K ? b + 16 : NULL;
}

/* Weights 8i .. 8i + 7 of the super-block. */
static inline __attribute__((always_inline)) __m256 k_vector(const int type, const KScales *ks, int i) {
    __m256i fifteen = _mm256_set1_epi32(15);
    if (type == T_Q6_K) {
        int h = i / 16, c = (i % 16) / 4, l = (i % 4) * 8;
        __m256i lo = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(ks->lo + h * 64 + (c & 1) * 32 + l)));
        __m256i hb = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(ks->hi + h * 32 + l)));
        lo = c < 2 ? _mm256_and_si256(lo, fifteen) : _mm256_srli_epi32(lo, 4);
        hb = _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(hb, 2 * c), _mm256_set1_epi32(3)), 4);
        __m256 v = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_or_si256(lo, hb), _mm256_set1_epi32(32)));
        return _mm256_mul_ps(_mm256_set1_ps(ks->ds[h * 8 + c * 2 + l / 16]), v);
    }
    int j = i / 4, l = (i % 4) * 8;
    __m256i v = _mm256_and_si256(
        _mm256_srli_epi32(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(ks->lo + (j / 2) * 32 + l))), (j % 2) * 4),
        fifteen);
    if (type == T_Q5_K) {
        __m256i h = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(ks->hi + l)));
        v = _mm256_or_si256(v, _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(h, j), _mm256_set1_epi32(1)), 4));
    }
    return _mm256_fmsub_ps(_mm256_set1_ps(ks->ds[j]), _mm256_cvtepi32_ps(v), _mm256_set1_ps(ks->dm[j]));
}

#define K_ROWS 6 /* rows sharing each super-block's vectors */

/* 8-lane accumulators on the AVX-512 path too (the same sums): a 16-lane one would cost a
 * register insert per two vectors, and ran slower. */
static inline __attribute__((always_inline)) void q_k_float_rows(const int type, const uint8_t *row, const float *x, int64_t ldx,
                                                           const int G, int K, float *y, int64_t ldy) {
    const int bb = type == T_Q6_K ? 210 : type == T_Q5_K ? 176 : 144;
    __m256 a[K_ROWS][2];
    for (int s = 0; s < G; s++) a[s][0] = a[s][1] = _mm256_setzero_ps();
    for (int k0 = 0; k0 < K; k0 += 256, row += bb) {
        KScales ks;
        k_scales(type, row, &ks);
#pragma GCC unroll 32
        for (int i = 0; i < 32; i++) {  /* unrolled: every index and shift a constant */
            __m256 w = k_vector(type, &ks, i);
            for (int s = 0; s < G; s++) a[s][i & 1] = _mm256_fmadd_ps(w, _mm256_loadu_ps(x + s * ldx + k0 + 8 * i), a[s][i & 1]);
        }
    }
    for (int s = 0; s < G; s++) y[s * ldy] = lanes_sum8(_mm256_add_ps(a[s][0], a[s][1]));
}

#define K_CASE(T, n) case n: q_k_float_rows(T, row, x + s * ldx, ldx, n, K, y + s * ldy, ldy); break;
#define K_GROUPS(T)                                                                         \
    for (int s = 0, left = (S + K_ROWS - 1) / K_ROWS; s < S; left--) {                      \
        int g = (S - s + left - 1) / left;                                                  \
        switch (g) {                                                                        \
        K_CASE(T, 1) K_CASE(T, 2) K_CASE(T, 3) K_CASE(T, 4) K_CASE(T, 5)                    \
        default: q_k_float_rows(T, row, x + s * ldx, ldx, K_ROWS, K, y + s * ldy, ldy); break;   \
        }                                                                                   \
        s += g;                                                                             \
    }                                                                                       \
    return 1;

/* All S rows against one weight row read in place: 1 when the type has this path, else 0. */
static int fused_rows(int type, const uint8_t *row, const float *x, int64_t ldx, int S, int K, float *y, int64_t ldy) {
    switch (type) {
    case T_Q4_0: FUSED_GROUPS(T_Q4_0)
    case T_Q4_1: FUSED_GROUPS(T_Q4_1)
    case T_Q5_0: FUSED_GROUPS(T_Q5_0)
    case T_Q5_1: FUSED_GROUPS(T_Q5_1)
    case T_Q8_0: FUSED_GROUPS(T_Q8_0)
    case T_Q4_K: K_GROUPS(T_Q4_K)
    case T_Q5_K: K_GROUPS(T_Q5_K)
    case T_Q6_K: K_GROUPS(T_Q6_K)
    default: return 0;
    }
}
#define HAVE_FUSED 1
#else
static void dot_rows(const float *w, const float *x, int64_t ldx, int g, int K, float *y, int64_t ldy) {
    for (int s = 0; s < g; s++) {
        const float *xs = x + s * ldx;
        float a[LANES] = {0};
        for (int k = 0; k < K; k += LANES)
            for (int l = 0; l < LANES; l++) a[l] = fmaf(w[k + l], xs[k + l], a[l]);
        for (int width = LANES / 2; width >= 1; width /= 2)
            for (int l = 0; l < width; l++) a[l] += a[l + width];
        y[s * ldy] = a[0];
    }
}
#endif

/* Outputs [o0, o1) of the stacked parts (numbered across parts), all S rows of x [S, K]:
 * y[s][o] for o in the range. w: scratch for K floats. */
static void stacked_outputs(const float *x, int S, int K, const struct part *parts, int nparts, int64_t o0, int64_t o1,
                            float *y, int64_t ldy, float *w) {
    int64_t base = 0;
    for (int i = 0; i < nparts && base < o1; base += parts[i].rows, i++) {
        int64_t lo = o0 > base ? o0 - base : 0, hi = o1 - base < parts[i].rows ? o1 - base : parts[i].rows;
#ifdef HAVE_FUSED
        if (S == 1 && fused_outs(parts[i].type, (const uint8_t *)parts[i].data, parts[i].ld, lo, hi, x, K, y + base)) continue;
#endif
        for (int64_t r = lo; r < hi; r++) {
#ifdef HAVE_FUSED
            const uint8_t *row = (const uint8_t *)parts[i].data + r * parts[i].ld;
            if (r + PREFETCH_ROWS < parts[i].rows)
                for (int64_t b = 0; b < parts[i].ld; b += 64) __builtin_prefetch(row + PREFETCH_ROWS * parts[i].ld + b, 0, 3);
            if (fused_rows(parts[i].type, row, x, K, S, K, y + base + r, ldy)) continue;
#endif
            dequant_row(&parts[i], r, K, w);
            dot_rows(w, x, K, S, K, y + base + r, ldy);
        }
    }
}

/* y [S, N] = x [S, K] @ W^T, W the stacked parts ([N, K] in all), jobs of OUT_JOB outputs over
 * the threads. Returns non-zero when scratch memory could not be had. */
static int stacked_product(const float *x, int S, int K, const struct part *parts, int nparts, float *y, int threads) {
    int64_t N = 0;
    for (int i = 0; i < nparts; i++) N += parts[i].rows;
    int64_t jobs = (N + OUT_JOB - 1) / OUT_JOB;
    int nt = (int64_t)S * K * N < (1 << 16) ? 1 : threads, failed = 0;
#pragma omp parallel num_threads(nt) if (nt > 1)
    {
        float *w = malloc(sizeof(float) * (size_t)K);
        if (!w) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t j = 0; j < jobs; j++) {
            int64_t o1 = (j + 1) * OUT_JOB < N ? (j + 1) * OUT_JOB : N;
            if (w) stacked_outputs(x, S, K, parts, nparts, j * OUT_JOB, o1, y, N, w);
        }
        free(w);
    }
    return failed ? -1 : 0;
}

/* out [n, K] = the given rows of one part as float32 (rows NULL: rows 0..n-1). The embedding's
 * lookup and the dense tiles of a prefill's matrix products. */
int dequantize_rows(const void *data, int64_t ld, int type, int K, const int64_t *rows, int64_t n, float *out,
                    int threads) {
    struct part p = {data, ld, type, 0};
    if (!block_bytes(type) || K % block_weights(type)) return -1;
    int nt = n * K < (1 << 16) ? 1 : threads;
#pragma omp parallel for schedule(static) num_threads(nt) if (nt > 1)
    for (int64_t i = 0; i < n; i++) dequant_row(&p, rows ? rows[i] : i, K, out + i * K);
    return 0;
}
