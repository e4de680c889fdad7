/* Few-row attention over a long cache: R query rows (a decoding step, a verification of a
 * few drafted tokens, grouped-query heads folded into rows) against T cached keys, reading
 * each key and value once for all rows.
 *
 * The work is split into jobs of (head, block of keys). A job computes its block's scores for
 * every row (the block's keys stay in cache while all rows use them), the block's softmax
 * statistics (max and sum of exponentials), and its block's partial output. `merge` then
 * combines the blocks by their statistics, as flash-decoding does. `attention` runs the jobs
 * on OpenMP threads; nothing here allocates beyond one scratch buffer per thread.
 *
 * Compiled at first use with the machine's own vector instructions: AVX2 products over groups
 * of rows where the machine has them, plain C elsewhere. A row's result is the same bit for bit
 * whatever the number of rows in the call (each sum is formed in one fixed order), so a
 * verification row equals the decoding step it replaces.
 *
 * Keys and values are float32, float16 or bfloat16 (`kind`); 16-bit ones are widened to float32
 * as they are loaded (F16C's vcvtph2ps for float16, a 16-bit shift for bfloat16; both exact) and
 * everything after runs in float32 as for float32 K/V: the result equals, bit for bit, this
 * kernel's over the widened K/V, and half the bytes are read.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define HAVE_AVX2 1
#endif
#if defined(__F16C__)
#include <immintrin.h>
#endif

/* What the keys and values are stored as (`kind`). */
enum { KV_F32 = 0, KV_F16 = 1, KV_BF16 = 2 };
#define INLINE static inline __attribute__((always_inline))

static inline int kv_size(int kind) { return kind == KV_F32 ? 4 : 2; }

/* IEEE half -> float, exactly (every half is a float): normal, subnormal, zero, inf, NaN. */
static inline float half_to_float(uint16_t h) {
    union { uint32_t i; float f; } u;
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
    if (e == 0x1fu) {
        u.i = sign | 0x7f800000u | (m << 13);
    } else if (e != 0) {
        u.i = sign | ((e + 112u) << 23) | (m << 13);
    } else {  /* zero or subnormal: m * 2^-24, exact in float */
        u.f = (float)m * 5.9604644775390625e-8f;
        u.i |= sign;
    }
    return u.f;
}

/* Element i of K or V as float32. */
INLINE float load1(const void *p, int64_t i, const int kind) {
    if (kind == KV_F16) {
#ifdef __F16C__
        return _cvtsh_ss(((const uint16_t *)p)[i]);
#else
        return half_to_float(((const uint16_t *)p)[i]);
#endif
    }
    if (kind == KV_BF16) {
        union { uint32_t i; float f; } u;
        u.i = (uint32_t)((const uint16_t *)p)[i] << 16;
        return u.f;
    }
    return ((const float *)p)[i];
}

#define LANES 8
/* With several rows, a block is worked through in pieces of SUB_BYTES of keys (64 keys of 64
 * floats): every row passes over one piece while it sits in the level-1 cache, where a whole
 * 64 KB block would be read again from level 2 by each row (faster with several rows; the same
 * bits: each key's score and each row's running sum are formed in the same order). */
#ifndef SUB_BYTES
#define SUB_BYTES 16384
#endif

/* exp(x) for x <= 0, to about 2 ulp: x = n ln2 + r, |r| <= ln2/2, a degree-6 polynomial
 * for exp(r), 2^n built in the exponent bits. Below -87 (where exp underflows float's normal
 * range) the result is exp(-87), 1.6e-38: nothing next to the row's largest term, exp(0). */
#define EXP_C(X) X(1.9875691500e-4f) X(1.3981999507e-3f) X(8.3334519073e-3f) X(4.1665795894e-2f) \
    X(1.6666665459e-1f) X(5.0000001201e-1f)
static const float LOG2E = 1.44269504088896341f, LN2_HI = 0.693359375f, LN2_LO = -2.12194440e-4f;

static inline float exp_nonpositive(float x) {
    x = x < -87.0f ? -87.0f : x;
    float fn = floorf(x * LOG2E + 0.5f);
    float r = x - fn * LN2_HI - fn * LN2_LO;
    float p = 0.0f;
#define STEP(c) p = p * r + c;
    EXP_C(STEP)
#undef STEP
    p = p * r * r + r + 1.0f;
    union { int32_t i; float f; } scale;
    scale.i = ((int32_t)fn + 127) << 23;
    return p * scale.f;
}

/* exp_nonpositive's steps on a vector of BITS (256, 512) floats x, returned; FLOOR rounds down. */
#define EXP_NONPOSITIVE_VECTOR(BITS, FLOOR)                                                              \
    x = _mm##BITS##_max_ps(x, _mm##BITS##_set1_ps(-87.0f));                                              \
    __m##BITS fn = FLOOR(_mm##BITS##_fmadd_ps(x, _mm##BITS##_set1_ps(LOG2E), _mm##BITS##_set1_ps(0.5f)));\
    __m##BITS r = _mm##BITS##_fnmadd_ps(fn, _mm##BITS##_set1_ps(LN2_HI), x);                             \
    r = _mm##BITS##_fnmadd_ps(fn, _mm##BITS##_set1_ps(LN2_LO), r);                                       \
    __m##BITS p = _mm##BITS##_setzero_ps();                                                              \
    EXP_C(EXP_VECTOR_STEP_##BITS)                                                                        \
    p = _mm##BITS##_fmadd_ps(_mm##BITS##_mul_ps(p, r), r, _mm##BITS##_add_ps(r, _mm##BITS##_set1_ps(1.0f)));\
    __m##BITS##i e = _mm##BITS##_slli_epi32(                                                             \
        _mm##BITS##_add_epi32(_mm##BITS##_cvtps_epi32(fn), _mm##BITS##_set1_epi32(127)), 23);            \
    return _mm##BITS##_mul_ps(p, _mm##BITS##_castsi##BITS##_ps(e));
#define EXP_VECTOR_STEP_256(c) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c));
#define EXP_VECTOR_STEP_512(c) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));

#ifdef HAVE_AVX2
static inline __m256 exp_nonpositive8(__m256 x) { EXP_NONPOSITIVE_VECTOR(256, _mm256_floor_ps) }
#endif

/* The largest of s[0..n) (-inf for n = 0). */
static float row_max(const float *s, int n) {
    float m = -INFINITY;
    int t = 0;
#ifdef HAVE_AVX2
    if (n >= 8) {
        __m256 mv = _mm256_loadu_ps(s);
        for (t = 8; t + 8 <= n; t += 8) mv = _mm256_max_ps(mv, _mm256_loadu_ps(s + t));
        float lanes[8];
        _mm256_storeu_ps(lanes, mv);
        for (int j = 0; j < 8; j++) m = lanes[j] > m ? lanes[j] : m;
    }
#endif
    for (; t < n; t++) m = s[t] > m ? s[t] : m;
    return m;
}

/* s[t] = exp(s[t] - m) in place; returns their sum. */
static float exponentiate(float *s, int n, float m) {
    float l = 0.0f;
    int t = 0;
#ifdef HAVE_AVX2
    __m256 mv = _mm256_set1_ps(m), acc = _mm256_setzero_ps();
    for (; t + 8 <= n; t += 8) {
        __m256 e = exp_nonpositive8(_mm256_sub_ps(_mm256_loadu_ps(s + t), mv));
        _mm256_storeu_ps(s + t, e);
        acc = _mm256_add_ps(acc, e);
    }
    float lanes[8];
    _mm256_storeu_ps(lanes, acc);
    for (int j = 0; j < 8; j++) l += lanes[j];
#endif
    for (; t < n; t++) {
        s[t] = exp_nonpositive(s[t] - m);
        l += s[t];
    }
    return l;
}

INLINE float dot(const float *a, const void *b, int64_t b0, int D, const int kind) {
    float acc[LANES] = {0};
    int d = 0;
    for (; d + LANES <= D; d += LANES)
        for (int j = 0; j < LANES; j++) acc[j] += a[d + j] * load1(b, b0 + d + j, kind);
    float s = 0.0f;
    for (; d < D; d++) s += a[d] * load1(b, b0 + d, kind);
    for (int j = 0; j < LANES; j++) s += acc[j];
    return s;
}

/* The next block's keys (or values) are brought into the level-2 cache while this block's rows
 * are computed from it: the rows after the first run from cache, and without this the memory
 * would stand idle during them. Into level 2, not level 1: a block (64 KB of keys) is larger
 * than level 1, where it evicted the piece the rows were working on.
 * `next` advances by `step` bytes per call, up to `end`.
 *
 * Where one group holds every row (a decoding step), that group's single pass streams the block
 * from memory, and each line `ahead` bytes past the one being read is also asked for, into
 * level 1: the hardware prefetchers stop at each 4 KB page's end, the hint does not (a step is
 * faster with it; a few KB either way ran alike). With several groups it is not asked for: the
 * groups after the first read the piece from cache, and the hints cost them. */
#define AHEAD_BYTES 4096
typedef struct { const char *next, *end; int64_t step; int ahead; } Prefetch;

/* The lines of [p + ahead, p + ahead + bytes), asked for into level 1. */
INLINE void prefetch_ahead(const Prefetch *pf, const void *p, int64_t bytes) {
    if (!pf->ahead) return;
    for (int64_t c = 0; c < bytes; c += 64) __builtin_prefetch((const char *)p + pf->ahead + c, 0, 3);
}

static inline void prefetch(Prefetch *pf) {
    for (int64_t i = 0; i < pf->step && pf->next < pf->end; i += 64, pf->next += 64)
        __builtin_prefetch(pf->next, 0, 1);
}

/* Rows are worked in groups: a group's rows share every key and value vector loaded, where one
 * row at a time needs a load for each multiply-add. A group's accumulators must fit the vector
 * registers: 16 with AVX2, 32 with AVX-512's (where groups of 2, 4 and 6 rows ran alike). */
#ifdef __AVX512VL__
#define ROW_GROUP 4
#else
#define ROW_GROUP 2
#endif

/* Per row, s[t] = q . k[t]; q: rows D apart, s: rows `ss` apart. Without the vector path, one row at a time. */
INLINE void scores_scalar(const float *q, const void *k, int n, int D, float *s, int64_t ss, int rows, const int kind) {
    for (int r = 0; r < rows; r++)
        for (int t = 0; t < n; t++) s[r * ss + t] = dot(q + (int64_t)r * D, k, (int64_t)t * D, D, kind);
}

/* Per row, o[d] = sum_t w[t] v[t][d] over n values (with `more`, added to what o holds), each
 * o[d] one running sum in t order. */
INLINE void weighted_scalar(const float *w, int64_t ws, const void *v, int n, int D, float *o, int more, int rows,
                            const int kind) {
    for (int r = 0; r < rows; r++) {
        float *orow = o + (int64_t)r * D;
        if (!more)
            for (int d = 0; d < D; d++) orow[d] = 0.0f;
        for (int t = 0; t < n; t++) {
            float wt = w[r * ws + t];
            for (int d = 0; d < D; d++) orow[d] += wt * load1(v, (int64_t)t * D + d, kind);
        }
    }
}

#ifdef HAVE_AVX2
/* Eight elements of K or V from element i, as float32. */
INLINE __m256 load8(const void *p, int64_t i, const int kind) {
    if (kind == KV_F16) {
#ifdef __F16C__
        return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)p + i)));
#else
        float x[8];
        for (int j = 0; j < 8; j++) x[j] = half_to_float(((const uint16_t *)p)[i + j]);
        return _mm256_loadu_ps(x);
#endif
    }
    if (kind == KV_BF16)
        return _mm256_castsi256_ps(
            _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const uint16_t *)p + i))), 16));
    return _mm256_loadu_ps((const float *)p + i);
}

/* The lane sums of four vectors, each by the same tree ((l0+l1)+(l2+l3))+((l4+l5)+(l6+l7)). */
INLINE __m128 lane_sums(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
    __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
    return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

/* Scores of `rb` rows (a compile-time constant at each call) over n keys (D % 8 == 0): keys in
 * fours, each key vector loaded once for all rows. Every score is one chain of multiply-adds
 * over d, then the lane tree, whatever rb: a row's scores are equal bit for bit however many
 * rows share its call. (Eight keys at a time gave one row more independent chains but ran
 * slower over a cache in memory, the hardware prefetcher following eight lines at once.) */
INLINE void scores_avx2(const float *q, const void *k, int n, int D, float *s, int64_t ss, const int rb, Prefetch *pf,
                         const int kind) {
    const int kb = 4;
    for (int t = 0; t < n; t += kb) {
        const int m = n - t < kb ? n - t : kb;  /* keys present; absent ones are zero vectors */
        const int64_t k0 = (int64_t)t * D;
        prefetch(pf);
        prefetch_ahead(pf, (const char *)k + k0 * kv_size(kind), (int64_t)kb * D * kv_size(kind));
        __m256 acc[ROW_GROUP][4];
#pragma GCC unroll 8
        for (int r = 0; r < rb; r++)
#pragma GCC unroll 8
            for (int j = 0; j < kb; j++) acc[r][j] = _mm256_setzero_ps();
        for (int i = 0; i < D; i += 8) {
            __m256 kv[4];
#pragma GCC unroll 8
            for (int j = 0; j < kb; j++)
                kv[j] = m == kb || j < m ? load8(k, k0 + (int64_t)j * D + i, kind) : _mm256_setzero_ps();
#pragma GCC unroll 8
            for (int r = 0; r < rb; r++) {
                __m256 qv = _mm256_loadu_ps(q + (int64_t)r * D + i);
#pragma GCC unroll 8
                for (int j = 0; j < kb; j++) acc[r][j] = _mm256_fmadd_ps(qv, kv[j], acc[r][j]);
            }
        }
#pragma GCC unroll 8
        for (int r = 0; r < rb; r++) {
            __m128 x = lane_sums(acc[r][0], acc[r][1], acc[r][2], acc[r][3]);
            float *out = s + r * ss + t;
            if (m == 4) {
                _mm_storeu_ps(out, x);
            } else {
                float lanes[4];
                _mm_storeu_ps(lanes, x);
                for (int e = 0; e < m; e++) out[e] = lanes[e];
            }
        }
    }
}

/* The weighted sums of `rb` rows over n values (D % (8 dv) == 0; rb and dv compile-time
 * constants at each call): d in pieces of dv vectors, each value vector loaded once for all
 * rows; every o[d] one running sum in t order, as in weighted_scalar, whatever rb and dv. */
INLINE void weighted_avx2(const float *w, int64_t ws, const void *v, int n, int D, float *o, int more, const int rb,
                           const int dv, Prefetch *pf, const int kind) {
    for (int d0 = 0; d0 < D; d0 += 8 * dv) {
        __m256 acc[ROW_GROUP][8];
#pragma GCC unroll 8
        for (int r = 0; r < rb; r++)
#pragma GCC unroll 8
            for (int j = 0; j < dv; j++)
                acc[r][j] = more ? _mm256_loadu_ps(o + (int64_t)r * D + d0 + 8 * j) : _mm256_setzero_ps();
        for (int t = 0; t < n; t++) {
            if (d0 == 0 && (t & 3) == 0) prefetch(pf);
            const int64_t vt = (int64_t)t * D + d0;
            if (d0 == 0) prefetch_ahead(pf, (const char *)v + vt * kv_size(kind), (int64_t)D * kv_size(kind));
            __m256 vv[8];
#pragma GCC unroll 8
            for (int j = 0; j < dv; j++) vv[j] = load8(v, vt + 8 * j, kind);
#pragma GCC unroll 8
            for (int r = 0; r < rb; r++) {
                __m256 wt = _mm256_broadcast_ss(w + r * ws + t);
#pragma GCC unroll 8
                for (int j = 0; j < dv; j++) acc[r][j] = _mm256_fmadd_ps(wt, vv[j], acc[r][j]);
            }
        }
#pragma GCC unroll 8
        for (int r = 0; r < rb; r++)
#pragma GCC unroll 8
            for (int j = 0; j < dv; j++) _mm256_storeu_ps(o + (int64_t)r * D + d0 + 8 * j, acc[r][j]);
    }
}
#endif

/* `rows` (<= ROW_GROUP) rows' scores and weighted sums, dispatched to the group of that size. */
INLINE void scores_rows(const float *q, const void *k, int n, int D, float *s, int64_t ss, int rows, Prefetch *pf,
                        const int kind) {
#ifdef HAVE_AVX2
    if (D % 8 == 0) {
        switch (rows) {
        case 1: scores_avx2(q, k, n, D, s, ss, 1, pf, kind); return;
        case 2: scores_avx2(q, k, n, D, s, ss, 2, pf, kind); return;
#if ROW_GROUP >= 4
        case 3: scores_avx2(q, k, n, D, s, ss, 3, pf, kind); return;
        case 4: scores_avx2(q, k, n, D, s, ss, 4, pf, kind); return;
#endif
        }
    }
#endif
    (void)pf;
    scores_scalar(q, k, n, D, s, ss, rows, kind);
}

INLINE void weighted_rows(const float *w, int64_t ws, const void *v, int n, int D, float *o, int more, int rows,
                          Prefetch *pf, const int kind) {
#ifdef HAVE_AVX2
    if (D % 32 == 0) {
        switch (rows) {
        case 1:  /* one row: eight chains of multiply-adds where D allows, to keep both units busy */
            if (D % 64 == 0) weighted_avx2(w, ws, v, n, D, o, more, 1, 8, pf, kind);
            else weighted_avx2(w, ws, v, n, D, o, more, 1, 4, pf, kind);
            return;
        case 2: weighted_avx2(w, ws, v, n, D, o, more, 2, 4, pf, kind); return;
#if ROW_GROUP >= 4
        case 3: weighted_avx2(w, ws, v, n, D, o, more, 3, 4, pf, kind); return;
        case 4: weighted_avx2(w, ws, v, n, D, o, more, 4, 4, pf, kind); return;
#endif
        }
    }
#endif
    (void)pf;
    weighted_scalar(w, ws, v, n, D, o, more, rows, kind);
}

/* Rounding down, as _mm256_floor_ps does (integer_attention.c takes the 16-lane exponential too). */
#define FLOOR512(v) _mm512_roundscale_ps(v, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC)
#ifdef __AVX512F__
static inline __m512 exp_nonpositive_16(__m512 x) { EXP_NONPOSITIVE_VECTOR(512, FLOOR512) }

#endif

/* A block's softmax: per row r of the scores s (rows `ss` apart, n keys from t0), the visible
 * part (keys first[r] <= t < limit[r]), its max m and the exponentials exp(s - m) in place (zero
 * where the row does not see), their sum l (at m_out, l_out [stat + r]), and with chunk_sum each
 * whole chunk's sum, as `blocks` documents them. */
static void block_softmax(float *s, int64_t ss, int R, const int64_t *limit, const int64_t *first, int64_t T, int64_t t0,
                          int n, int64_t h, int64_t stat, int chunk, int64_t n_chunks, float *chunk_sum, float *m_out,
                          float *l_out) {
    for (int r = 0; r < R; r++) {
        float *sr = s + (int64_t)r * ss;
        int64_t lim = (limit ? limit[r] : T) - t0, low = (first ? first[r] : 0) - t0;
        int seen = lim <= 0 ? 0 : (lim < n ? (int)lim : n);
        int lo = low <= 0 ? 0 : (low < seen ? (int)low : seen);  /* keys [lo, seen) of the block */
        float m = row_max(sr + lo, seen - lo);
        float l = seen > lo ? exponentiate(sr + lo, seen - lo, m) : 0.0f;
        for (int t = 0; t < lo; t++) sr[t] = 0.0f;
        for (int t = seen; t < n; t++) sr[t] = 0.0f;
        m_out[stat + r] = m;
        l_out[stat + r] = l;
        if (chunk_sum) {
            float *cs = chunk_sum + (h * R + r) * n_chunks;
            for (int c = 0; c * chunk < n && t0 / chunk + c < n_chunks; c++) {
                float acc = 0.0f;
                for (int t = c * chunk; t < (c + 1) * chunk; t++) acc += sr[t];
                cs[t0 / chunk + c] = acc;
            }
        }
    }
}

/* q: [H, R, D] pre-scaled; k, v (`kind`): head h at element h * head_stride, token t at + t * D;
 * limit[r]: row r sees keys t < limit[r] (limit NULL: every key), and first[r] <= t (first NULL:
 * from the first; a sliding window). Blocks of `block` keys, nb = ceil(T / block): a row's
 * result depends on which keys share a block, so a window's keys are given from a multiple of
 * `block` (`kv.full`) for its rows to equal its one-token steps bit for bit.
 * out: [H, nb, R, D]; m_out, l_out: [H, nb, R] (m = -inf for a block the row cannot see).
 * chunk_sum (optional, block % chunk == 0): [H, R, T / chunk], the sum of exp(s - m) of the
 * block over each whole chunk of keys the row sees (zero past what it sees). */
INLINE int blocks(const float *q, const void *k, const void *v, int64_t head_stride,
                  int H, int R, int D, int64_t T, const int64_t *limit, const int64_t *first, int block,
                  int64_t job_begin, int64_t job_end, float *out, float *m_out, float *l_out,
                  int chunk, float *chunk_sum, const int kind) {
    int64_t nb = (T + block - 1) / block;
    float *s = malloc(sizeof(float) * (size_t)R * (size_t)block);
    if (!s) return -1;
    int64_t n_chunks = chunk > 0 ? T / chunk : 0;
    const int64_t es = kv_size(kind);
    /* pieces counted in float32 keys whatever the K/V dtype (float16, one thread, 3-16 rows: 8, 16
       and 32 KB pieces ran alike) */
    int sub = R == 1 ? block : SUB_BYTES / (4 * D) / 4 * 4;
    sub = sub < 4 ? 4 : sub;

    for (int64_t job = job_begin; job < job_end; job++) {
        int64_t h = job / nb, b = job % nb;
        int64_t t0 = b * block;
        int n = (int)((T - t0) < block ? (T - t0) : block);
        const char *kh = (const char *)k + (h * head_stride + t0 * D) * es;
        const char *vh = (const char *)v + (h * head_stride + t0 * D) * es;
        const float *qh = q + h * (int64_t)R * D;
        /* 1. scores, one piece of `sub` keys at a time for every group of rows (the piece stays
           in the level-1 cache while the groups read it, the block in level 2); the next
           block is prefetched, spread over the groups' passes (not for one row: a single
           pass streams, and not past the head's last block) */
        int last = b + 1 == nb, groups = (R + ROW_GROUP - 1) / ROW_GROUP;
        int64_t bytes = (int64_t)block * D * es;
        int64_t step = R > 1 ? (bytes / ((int64_t)groups * (n / 4 + 1)) + 63) / 64 * 64 : 0;
        int ahead = groups == 1 ? AHEAD_BYTES : 0;
        Prefetch pk = {kh + (int64_t)n * D * es, kh + (int64_t)n * D * es + (last ? 0 : bytes), step, ahead};
        for (int u = 0; u < n; u += sub)
            for (int r = 0; r < R; r += ROW_GROUP)
                scores_rows(qh + (int64_t)r * D, kh + (int64_t)u * D * es, n - u < sub ? n - u : sub, D,
                            s + (int64_t)r * block + u, block, R - r < ROW_GROUP ? R - r : ROW_GROUP, &pk, kind);
        /* 2. per row: the visible part, its max, exponentials and their sum */
        int64_t stat = (h * nb + b) * R;
        float *o = out + stat * D;
        block_softmax(s, block, R, limit, first, T, t0, n, h, stat, chunk, n_chunks, chunk_sum, m_out, l_out);
        /* 3. the block's partial output, piece by piece as the scores (each row's running sum
           is stored between pieces and taken up again in the same order) */
        Prefetch pv = {vh + (int64_t)n * D * es, vh + (int64_t)n * D * es + (last ? 0 : bytes), step, ahead};
        for (int u = 0; u < n; u += sub)
            for (int r = 0; r < R; r += ROW_GROUP)
                weighted_rows(s + (int64_t)r * block + u, block, vh + (int64_t)u * D * es, n - u < sub ? n - u : sub, D,
                              o + (int64_t)r * D, u > 0, R - r < ROW_GROUP ? R - r : ROW_GROUP, &pv, kind);
    }
    free(s);
    return 0;
}

/* `blocks` compiled once per kind of K/V, each with its loads fixed. */
static int blocks_f32(const void *q, const void *k, const void *v, int64_t hs, int H, int R, int D, int64_t T,
                      const int64_t *limit, const int64_t *first, int block, int64_t j0, int64_t j1, float *out,
                      float *m, float *l, int chunk, float *cs) {
    return blocks((const float *)q, k, v, hs, H, R, D, T, limit, first, block, j0, j1, out, m, l, chunk, cs, KV_F32);
}
static int blocks_f16(const void *q, const void *k, const void *v, int64_t hs, int H, int R, int D, int64_t T,
                      const int64_t *limit, const int64_t *first, int block, int64_t j0, int64_t j1, float *out,
                      float *m, float *l, int chunk, float *cs) {
    return blocks((const float *)q, k, v, hs, H, R, D, T, limit, first, block, j0, j1, out, m, l, chunk, cs, KV_F16);
}
static int blocks_bf16(const void *q, const void *k, const void *v, int64_t hs, int H, int R, int D, int64_t T,
                       const int64_t *limit, const int64_t *first, int block, int64_t j0, int64_t j1, float *out,
                       float *m, float *l, int chunk, float *cs) {
    return blocks((const float *)q, k, v, hs, H, R, D, T, limit, first, block, j0, j1, out, m, l, chunk, cs, KV_BF16);
}
typedef int (*BlocksFn)(const void *, const void *, const void *, int64_t, int, int, int, int64_t, const int64_t *,
                        const int64_t *, int, int64_t, int64_t, float *, float *, float *, int, float *);


/* heads x rows x blocks x head size from which the merge is split over the threads. */
#define MERGE_PARALLEL (1 << 16)

/* Combine the blocks: result [H, R, D]; m_out is overwritten with each block's weight
 * exp(m_b - max_b m_b) / sum_b l_b exp(m_b - max_b m_b), the factor that turns its
 * exponentials into attention probabilities, and the chunk sums (when asked: `block` keys a
 * block, `chunk` a chunk) are multiplied by it, becoming each chunk's attention probability. */
static void merge(int H, int R, int D, int64_t nb, const float *out, float *m_out, const float *l_out, float *result,
                  int64_t T, int block, int chunk, float *chunk_sum, int threads) {
    /* each (head, row) is merged on its own, by one thread: the same bits whatever the threads;
       split over the threads only where the work is large (on one, the others wait) */
    (void)threads;
#ifdef _OPENMP
#pragma omp parallel for collapse(2) schedule(static) num_threads(threads) if (threads > 1 && (int64_t)H * R * nb * D >= MERGE_PARALLEL)
#endif
    for (int h = 0; h < H; h++)
        for (int r = 0; r < R; r++) {
            float top = -INFINITY;
            for (int64_t b = 0; b < nb; b++) {
                float m = m_out[(h * nb + b) * R + r];
                top = m > top ? m : top;
            }
            float total = 0.0f;
            for (int64_t b = 0; b < nb; b++) {
                int64_t i = (h * nb + b) * R + r;
                float w = m_out[i] == -INFINITY ? 0.0f : expf(m_out[i] - top);
                m_out[i] = w;
                total += w * l_out[i];
            }
            float *res = result + ((int64_t)h * R + r) * D;
            for (int d = 0; d < D; d++) res[d] = 0.0f;
            for (int64_t b = 0; b < nb; b++) {
                int64_t i = (h * nb + b) * R + r;
                float w = m_out[i] / total;
                m_out[i] = w;
                if (chunk_sum) {
                    int64_t n_chunks = T / chunk, c0 = b * block / chunk, c1 = (b + 1) * block / chunk;
                    float *cs = chunk_sum + ((int64_t)h * R + r) * n_chunks;
                    for (int64_t c = c0; c < c1 && c < n_chunks; c++) cs[c] *= w;
                }
                if (w == 0.0f) continue;
                const float *o = out + i * D;
                for (int d = 0; d < D; d++) res[d] += w * o[d];
            }
        }
}

/* The whole attention: the jobs split evenly over `threads` threads of the OpenMP runtime (in
 * a process that has loaded PyTorch, its runtime: the same threads that run its operators, so
 * they neither wait for each other nor compete for the cores), then the merge. Arguments as
 * for `blocks` and `merge`, `kind` what k and v hold (KV_F32, KV_F16, KV_BF16); returns -1 when
 * a scratch buffer could not be allocated, -2 for an unknown kind. */
int attention_band(const float *q, const void *k, const void *v, int64_t head_stride, int kind,
                   int H, int R, int D, int64_t T, const int64_t *limit, const int64_t *first, int block, int threads,
                   float *out, float *m_out, float *l_out, int chunk, float *chunk_sum, float *result) {
    int64_t nb = (T + block - 1) / block, jobs = H * nb;
    BlocksFn blocks_of = kind == KV_F16 ? blocks_f16 : kind == KV_BF16 ? blocks_bf16 : blocks_f32;
    if (kind != KV_F32 && kind != KV_F16 && kind != KV_BF16) return -2;
    int failed = 0;
    const void *qa = q;
#ifdef _OPENMP
#pragma omp parallel num_threads(threads) reduction(| : failed)
    {
        int64_t n = omp_get_num_threads(), i = omp_get_thread_num();
        failed |= blocks_of(qa, k, v, head_stride, H, R, D, T, limit, first, block, jobs * i / n, jobs * (i + 1) / n,
                            out, m_out, l_out, chunk, chunk_sum);
    }
#else
    (void)threads;
    failed = blocks_of(qa, k, v, head_stride, H, R, D, T, limit, first, block, 0, jobs, out, m_out, l_out, chunk,
                       chunk_sum);
#endif
    if (!failed) merge(H, R, D, nb, out, m_out, l_out, result, T, block, chunk, chunk > 0 ? chunk_sum : NULL, threads);
    return failed;
}

/* `attention_band` with every row seeing keys from the first (no window). */
int attention(const float *q, const void *k, const void *v, int64_t head_stride, int kind,
              int H, int R, int D, int64_t T, const int64_t *limit, int block, int threads,
              float *out, float *m_out, float *l_out, int chunk, float *chunk_sum, float *result) {
    return attention_band(q, k, v, head_stride, kind, H, R, D, T, limit, NULL, block, threads, out, m_out, l_out, chunk,
                          chunk_sum, result);
}

#include <string.h>
#include "amx.c"
#include "integer_attention.c"
