/* Integer products over 16-bit activations for the 256-weight types (Q4_K, Q5_K, Q6_K):
 * `int8.WIDE`, the fast path's default.
 *
 * Why 16 bits: 8-bit activations (llama.cpp's arithmetic) move the model's numbers by up to
 * half an 8-bit step an input, enough to change its top token too often for a default. Two
 * levels of 8 bits (the row, then its residual) keep about 15 bits, but pay two integer
 * products a row. A 16-bit activation keeps about 16 bits for one: the weight times its
 * sub-block's integer scale fits 16 bits too (Q4_K 63 * 15, Q5_K 63 * 31, Q6_K 128 * 32 with
 * Q6_K's bias of 32 inside the weight), so one vpdpwssd multiplies 32 of them by 32 activations
 * and adds the pairs. A super-block's weights are scaled and widened once for all rows, by
 * vpmaddubsw against their scales at every other byte (the other bytes zero: one product a
 * pair, so no saturation): 64 weights give their even and their odd ones as two registers. A
 * further row then costs 8 vpdpwssd a super-block, as one level of 8 bits.
 *
 * An activation block (struct block_q16_k) is 256 inputs: x ~ d q with d = max|x| / 32767 and
 * q = round(x / d) (roundf: half away from zero), and the sums of q per 32 (the Q4_K and Q5_K
 * minimums). Each row is quantized on its own. The q are stored in the weights' order above:
 * of each 64 inputs, the 32 even ones, then the 32 odd ones (`q16_at`).
 *
 * One order of the float arithmetic, written once in the scalar reference (`q_k_int16_ref_block`) and
 * followed by every vector path. Per output and row, the 16 lanes and 8 offset lanes of
 * q_k_blocks.c's struct i8acc (its lanes 16-31 stay zero) and its i8_result:
 *   - super-block b adds to lane l < 16 V_l = sum of W_e q_e over e = 64 p + 4 l + t, p < 4,
 *     t < 4 (the lanes of q_k_blocks.c's K types), W_e = sc(e) w_e (Q6_K: sc(e) (w_e - 32)):
 *     lane = fmaf((float)V_l, d d_x, lane);
 *   - Q4_K, Q5_K: offset lane j < 8 gets M_j = m_j bsum_j:  lane = fmaf((float)M_j, dmin d_x, lane).
 * The integer sums are exact and bounded: |V_l| <= 16 * 4096 * 32767 < 2^31 (Q6_K, the largest);
 * a conversion to float rounds the same on every path. Nothing depends on the rows beside, the
 * thread or the vector path: a verification's row equals a step's bit for bit (tested).
 *
 * Included by layers.c after q_k_blocks.c (its paths, its probe and its accumulators).
 */

/* 256 inputs as 16-bit integers (576 bytes: a multiple of 64). */
struct block_q16_k {
    int16_t qs[256];  /* x ~ d q, of each 64 the even inputs first (`q16_at`) */
    float d;
    int32_t bsums[8]; /* sum of q per 32 inputs */
    int32_t pad[7];
};
_Static_assert(sizeof(struct block_q16_k) == 576, "block_q16_k is 576 bytes");

#define Q16_MAX 32767.0f

/* Where input e (0..255) of a block is stored: of its 64, the even ones first. */
static inline int q16_slot(int e) { return (e & ~63) + ((e & 1) << 5) + ((e & 63) >> 1); }
static inline int q16_at(const struct block_q16_k *x, int e) { return x->qs[q16_slot(e)]; }

static void quantize_q16_k_ref(const float *x, int K, struct block_q16_k *y) {
    for (int b = 0; b < K / 256; b++) {
        const float *xb = x + 256 * b;
        struct block_q16_k *o = &y[b];
        float amax = 0.0f;
        int nan = 0;
        for (int e = 0; e < 256; e++) {
            float a = fabsf(xb[e]);
            nan |= a != a;
            amax = a > amax ? a : amax;
        }
        /* A NaN or infinity makes d NaN or infinite, so the products are too, as the float path's. */
        float d = nan ? NAN : amax / Q16_MAX, id = d > 0.0f ? 1.0f / d : 0.0f;
        for (int j = 0; j < 8; j++) o->bsums[j] = 0;
        for (int e = 0; e < 256; e++) {
            float v = roundf(xb[e] * id);
            int16_t q = v != v ? 0 : v >= Q16_MAX ? 32767 : v <= -Q16_MAX ? -32767 : (int16_t)v;
            o->qs[q16_slot(e)] = q;
            o->bsums[e / 32] += q;
        }
        o->d = d;
        memset(o->pad, 0, sizeof(o->pad));
    }
}

#ifdef I8_X86
/* quantize_q16_k_ref in AVX-512, the same bits: the largest |x| is exact in any order; x * id is
 * the same product; roundf (half away from zero) is t = trunc(v) and one more away from zero
 * where |v - t| >= 0.5 (v - t is exact for a float); NaN gives 0 and the bounds clamp as there;
 * the sums per 32 are integer sums. (A prefill's rows spend a share of its time here.) */
static VNNI_TARGET void quantize_q16_k_vnni(const float *x, int K, struct block_q16_k *y) {
    const __m512 sign = _mm512_set1_ps(-0.0f), half = _mm512_set1_ps(0.5f), one = _mm512_set1_ps(1.0f);
    const __m512 hi = _mm512_set1_ps(Q16_MAX), lo = _mm512_set1_ps(-Q16_MAX);
    /* of 64 words (32 from each of two registers), the even ones, then the odd ones */
    __m512i even, odd;
    {
        int16_t e[32], o[32];
        for (int i = 0; i < 32; i++) e[i] = (int16_t)(2 * i), o[i] = (int16_t)(2 * i + 1);
        even = _mm512_loadu_si512((const void *)e);
        odd = _mm512_loadu_si512((const void *)o);
    }
    for (int b = 0; b < K / 256; b++) {
        const float *xb = x + 256 * b;
        struct block_q16_k *o = &y[b];
        __m512 amax = _mm512_setzero_ps();
        __mmask16 nan = 0;
        for (int e = 0; e < 256; e += 16) {
            __m512 a = _mm512_andnot_ps(sign, _mm512_loadu_ps(xb + e));
            nan |= _mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q);
            amax = _mm512_max_ps(amax, a);
        }
        float m = _mm512_reduce_max_ps(amax);
        float d = nan ? NAN : m / Q16_MAX, id = d > 0.0f ? 1.0f / d : 0.0f;
        const __m512 vid = _mm512_set1_ps(id);
        for (int g = 0; g < 4; g++) {  /* 64 inputs */
            __m512i q32[4];
            for (int j = 0; j < 4; j++) {
                __m512 v = _mm512_mul_ps(_mm512_loadu_ps(xb + 64 * g + 16 * j), vid);
                __m512 t = _mm512_roundscale_ps(v, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
                __mmask16 up = _mm512_cmp_ps_mask(_mm512_andnot_ps(sign, _mm512_sub_ps(v, t)), half, _CMP_GE_OQ);
                __m512 r = _mm512_mask_add_ps(t, up, t, _mm512_or_ps(one, _mm512_and_ps(sign, v)));
                r = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(r, r, _CMP_ORD_Q), r);  /* NaN -> 0 */
                r = _mm512_min_ps(_mm512_max_ps(r, lo), hi);
                q32[j] = _mm512_cvttps_epi32(r);
            }
            o->bsums[2 * g] = _mm512_reduce_add_epi32(_mm512_add_epi32(q32[0], q32[1]));
            o->bsums[2 * g + 1] = _mm512_reduce_add_epi32(_mm512_add_epi32(q32[2], q32[3]));
            __m512i a = _mm512_inserti64x4(_mm512_castsi256_si512(_mm512_cvtepi32_epi16(q32[0])), _mm512_cvtepi32_epi16(q32[1]), 1);
            __m512i c = _mm512_inserti64x4(_mm512_castsi256_si512(_mm512_cvtepi32_epi16(q32[2])), _mm512_cvtepi32_epi16(q32[3]), 1);
            _mm512_storeu_si512((void *)(o->qs + 64 * g), _mm512_permutex2var_epi16(a, even, c));
            _mm512_storeu_si512((void *)(o->qs + 64 * g + 32), _mm512_permutex2var_epi16(a, odd, c));
        }
        o->d = d;
        memset(o->pad, 0, sizeof(o->pad));
    }
}
#endif

/* A row's blocks, by the vector path the products take (the same bits on every path). */
static void quantize_q16_k(const float *x, int K, struct block_q16_k *y) {
#ifdef I8_X86
    if (int8_path() == INT8_AVX512_VNNI) {
        quantize_q16_k_vnni(x, K, y);
        return;
    }
#endif
    quantize_q16_k_ref(x, K, y);
}

/* x [S, K] -> S rows of K / 256 block_q16_k. Returns -1 where K is not a whole number of blocks. */
int int16_quantize_rows(const float *x, int S, int K, void *out) {
    if (K <= 0 || K % 256) return -1;
    for (int s = 0; s < S; s++) quantize_q16_k(x + (int64_t)s * K, K, (struct block_q16_k *)out + (int64_t)s * (K / 256));
    return 0;
}

/* ---- the scalar reference ---------------------------------------------------------------- */

/* Weight e of a super-block as the 16-bit integer the products take. */
static inline int q_k_int16_weight_ref(int type, const uint8_t *blk, int e) {
    int sc, q = q_k_weight_ref(type, blk, e, &sc);
    return type == T_Q6_K ? sc * (q - 32) : sc * q;
}

static void q_k_int16_ref_block(int type, const uint8_t *blk, const struct block_q16_k *x, struct i8acc *A) {
    int32_t V[16] = {0};
    for (int e = 0; e < 256; e++) V[(e % 64) / 4] += q_k_int16_weight_ref(type, blk, e) * q16_at(x, e);
    float dd = (type == T_Q6_K ? half_at(blk + 208) : half_at(blk)) * x->d;
    for (int l = 0; l < 16; l++) A->a[l] = fmaf((float)V[l], dd, A->a[l]);
    if (type == T_Q6_K) return;
    float dm = half_at(blk + 2) * x->d;
    for (int j = 0; j < 8; j++) {
        int sc, m;
        scale_min_k4(j, blk + 4, &sc, &m);
        A->m[j] = fmaf((float)(m * x->bsums[j]), dm, A->m[j]);
    }
}

static void q_k_int16_ref(int type, const uint8_t *row, const struct block_q16_k *x, int64_t ldx, int nb, int S, struct i8acc *A) {
    int bb = block_bytes(type);
    for (int s = 0; s < S; s++)
        for (int b = 0; b < nb; b++) q_k_int16_ref_block(type, row + (int64_t)b * bb, x + s * ldx + b, &A[s]);
}

#ifdef I8_X86
/* -- AVX2: a super-block's scaled weights into a buffer once for all rows, in the activations'
 *    order (of each 64, the even ones, then the odd), then per row 16 vpmaddwd: the first 16 of
 *    each 32 into lanes 0-7, the second 16 into lanes 8-15. */
static INLINE AVX2_TARGET void q_k_int16_avx2(const int type, const uint8_t *row, const struct block_q16_k *x, int64_t ldx, int nb,
                                        int S, struct i8acc *A) {
    struct unpackedk u;
    int16_t W[256] __attribute__((aligned(32)));
    const __m256i lo_byte = _mm256_set1_epi16(0x00ff), thirty_two = _mm256_set1_epi8(32);
    for (int b = 0; b < nb; b++) {
        const uint8_t *blk = row + (int64_t)b * block_bytes(type);
        float d, f;
        q_k_bytes_avx2(type, blk, &u, &d, &f);
        __m256i mins = _mm256_setzero_si256();
        if (type != T_Q6_K) {
            uint64_t scb, mnb;
            q4_k_scales(blk + 4, &scb, &mnb);
            mins = _mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)mnb));
        }
        for (int h = 0; h < 8; h++) {  /* weights 32h .. 32h + 31 */
            __m256i S;  /* each weight's scale as bytes */
            if (type == T_Q6_K) {
                const int8_t *sc = (const int8_t *)blk + 192 + 2 * h;
                S = _mm256_set_m128i(_mm_set1_epi8(sc[1]), _mm_set1_epi8(sc[0]));
            } else {
                int sc, m;
                scale_min_k4(h, blk + 4, &sc, &m);
                S = _mm256_set1_epi8((char)sc);
            }
            __m256i Se = _mm256_and_si256(S, lo_byte), So = _mm256_andnot_si256(lo_byte, S);
            __m256i q = _mm256_load_si256((const __m256i *)(u.q + 32 * h));
            __m256i we = _mm256_maddubs_epi16(q, Se), wo = _mm256_maddubs_epi16(q, So);
            if (type == T_Q6_K) {
                we = _mm256_sub_epi16(we, _mm256_maddubs_epi16(thirty_two, Se));
                wo = _mm256_sub_epi16(wo, _mm256_maddubs_epi16(thirty_two, So));
            }
            int16_t *at = W + 64 * (h / 2) + 16 * (h % 2);  /* even ones at 0 / 16, odd ones 32 further */
            _mm256_store_si256((__m256i *)at, we);
            _mm256_store_si256((__m256i *)(at + 32), wo);
        }
        for (int s = 0; s < S; s++) {
            const struct block_q16_k *xs = x + s * ldx + b;
            __m256i vlo = _mm256_setzero_si256(), vhi = vlo;
            for (int c = 0; c < 8; c++) {
                vlo = _mm256_add_epi32(vlo, _mm256_madd_epi16(_mm256_load_si256((const __m256i *)(W + 32 * c)),
                                                              _mm256_loadu_si256((const __m256i *)(xs->qs + 32 * c))));
                vhi = _mm256_add_epi32(vhi, _mm256_madd_epi16(_mm256_load_si256((const __m256i *)(W + 32 * c + 16)),
                                                              _mm256_loadu_si256((const __m256i *)(xs->qs + 32 * c + 16))));
            }
            __m256 dd = _mm256_set1_ps(d * xs->d);
            _mm256_store_ps(A[s].a, _mm256_fmadd_ps(_mm256_cvtepi32_ps(vlo), dd, _mm256_load_ps(A[s].a)));
            _mm256_store_ps(A[s].a + 8, _mm256_fmadd_ps(_mm256_cvtepi32_ps(vhi), dd, _mm256_load_ps(A[s].a + 8)));
            if (type != T_Q6_K) {
                __m256i M = _mm256_mullo_epi32(mins, _mm256_loadu_si256((const __m256i *)xs->bsums));
                _mm256_store_ps(A[s].m, _mm256_fmadd_ps(_mm256_cvtepi32_ps(M), _mm256_set1_ps(f * xs->d), _mm256_load_ps(A[s].m)));
            }
        }
    }
}

static AVX2_TARGET void q_k_int16_avx2_row(int type, const uint8_t *row, const struct block_q16_k *x, int64_t ldx, int nb, int S,
                                    struct i8acc *A) {
    switch (type) {
    case T_Q4_K: q_k_int16_avx2(T_Q4_K, row, x, ldx, nb, S, A); break;
    case T_Q5_K: q_k_int16_avx2(T_Q5_K, row, x, ldx, nb, S, A); break;
    case T_Q6_K: q_k_int16_avx2(T_Q6_K, row, x, ldx, nb, S, A); break;
    }
}

/* -- AVX-512 with VNNI: a super-block's 256 scaled weights in eight registers. Of the bytes of
 *    64 weights (vnni_k's registers), vpmaddubsw against their scales at the even bytes gives
 *    the even weights as 32 words, against the odd bytes the odd ones; the scales are put at
 *    every other byte by one vpshufb of the block's scales (an index with its top bit set gives
 *    a zero). Per row, eight vpdpwssd into two chains (even and odd), added: lane l is the
 *    reference's V_l. */

/* vpshufb indices for 64 weights p (bytes b = 0..63 of q[p]): byte b takes scale 4p + b / 16
 * (Q6_K, per 16) or 2p + b / 32 (per 32) where b's parity is `odd`, else a zero. */
static INLINE VNNI_TARGET __m512i scale_bytes_index(int per16, int p, int odd) {
    const __m512i iota = _mm512_set_epi8(63, 62, 61, 60, 59, 58, 57, 56, 55, 54, 53, 52, 51, 50, 49, 48, 47, 46, 45, 44, 43, 42,
                                         41, 40, 39, 38, 37, 36, 35, 34, 33, 32, 31, 30, 29, 28, 27, 26, 25, 24, 23, 22, 21, 20,
                                         19, 18, 17, 16, 15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    __m512i idx = per16 ? _mm512_add_epi8(_mm512_set1_epi8((char)(4 * p)), _mm512_and_si512(_mm512_srli_epi16(iota, 4), _mm512_set1_epi8(3)))
                        : _mm512_add_epi8(_mm512_set1_epi8((char)(2 * p)), _mm512_and_si512(_mm512_srli_epi16(iota, 5), _mm512_set1_epi8(1)));
    __mmask64 other = _mm512_test_epi8_mask(iota, _mm512_set1_epi8(1));  /* the odd bytes */
    if (odd) other = ~other;
    return _mm512_mask_mov_epi8(idx, other, _mm512_set1_epi8((char)0x80));
}

/* The vpshufb indices of scale_bytes_index for a type's super-block, c = 2p + odd. */
static INLINE VNNI_TARGET void q_k_int16_vnni_index(const int type, __m512i *index) {
    for (int p = 0; p < 4; p++)
        for (int odd = 0; odd < 2; odd++) index[2 * p + odd] = scale_bytes_index(type == T_Q6_K, p, odd);
}

/* A super-block's 256 scaled weights (W: eight registers, c = 2p + odd, the even weights of 64
 * then the odd), its d and, for Q4_K and Q5_K, its dmin (f, else 0) and integer minimums (mins:
 * the offset lanes' factors, else 0). */
static INLINE VNNI_TARGET void q_k_int16_vnni_widen(const int type, const uint8_t *blk, const __m512i *index, __m512i *W, float *d,
                                              float *f, __m256i *mins) {
    __m512i q[4], scales;
    q_k_bytes_vnni(type, blk, q);
    *mins = _mm256_setzero_si256();
    *f = 0.0f;
    if (type == T_Q6_K) {
        scales = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)(blk + 192)));
        *d = half_at(blk + 208);
    } else {
        uint64_t scb, mnb;
        q4_k_scales(blk + 4, &scb, &mnb);
        scales = _mm512_broadcast_i32x4(_mm_cvtsi64_si128((long long)scb));
        *mins = _mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)mnb));
        *d = half_at(blk);
        *f = half_at(blk + 2);
    }
    for (int c = 0; c < 8; c++) {
        __m512i sb = _mm512_shuffle_epi8(scales, index[c]);
        W[c] = _mm512_maddubs_epi16(q[c / 2], sb);
        if (type == T_Q6_K) W[c] = _mm512_sub_epi16(W[c], _mm512_maddubs_epi16(_mm512_set1_epi8(32), sb));
    }
}

/* An output's lanes set to zero before its first super-block, where the row's is first used
 * (in place of a memset of every accumulator of a group before the call: the same zeros, so
 * the same bits, without a pass over memory the kernel then overwrites). */
static INLINE VNNI_TARGET void q_k_int16_vnni_start(struct i8acc *A) {
    _mm512_store_ps(A->a, _mm512_setzero_ps());
    _mm512_store_ps(A->a + 16, _mm512_setzero_ps());
    _mm256_store_ps(A->m, _mm256_setzero_ps());
}

/* The rows against two outputs (row0, row1: their lanes A0[s], A1[s]): both outputs' super-block
 * b widened into registers, so each activation load feeds two products. Output by output, a
 * 7-row verification loaded each row's activations once per output (from the second level of
 * cache where the rows are wider than 2,048 inputs). The same operations on each lane in the
 * same order as q_k_int16_vnni. */
static INLINE VNNI_TARGET void q_k_int16_vnni_pair(const int type, const uint8_t *row0, const uint8_t *row1, const struct block_q16_k *x,
                                             int64_t ldx, int nb, int S, struct i8acc *A0, struct i8acc *A1) {
    const int bb = block_bytes(type);
    __m512i index[8];
    q_k_int16_vnni_index(type, index);
    for (int b = 0; b < nb; b++) {
        __m512i W0[8], W1[8];
        __m256i mins0, mins1;
        float d0, d1, f0, f1;
        q_k_int16_vnni_widen(type, row0 + (int64_t)b * bb, index, W0, &d0, &f0, &mins0);
        q_k_int16_vnni_widen(type, row1 + (int64_t)b * bb, index, W1, &d1, &f1, &mins1);
        for (int s = 0; s < S; s++) {
            const struct block_q16_k *xs = x + s * ldx + b;
            __m512i P0 = _mm512_setzero_si512(), Q0 = P0, P1 = P0, Q1 = P0;
            for (int c = 0; c < 8; c += 2) {
                __m512i X0 = _mm512_loadu_si512((const void *)(xs->qs + 32 * c));
                __m512i X1 = _mm512_loadu_si512((const void *)(xs->qs + 32 * c + 32));
                /* Each load once, in a register: left free, the compiler folds it into both
                 * outputs' vpdpwssd, and two 512-bit loads per product bound the loop (Zen 4:
                 * one a cycle), not the products. */
                __asm__("" : "+v"(X0), "+v"(X1));
                P0 = _mm512_dpwssd_epi32(P0, W0[c], X0);
                P1 = _mm512_dpwssd_epi32(P1, W1[c], X0);
                Q0 = _mm512_dpwssd_epi32(Q0, W0[c + 1], X1);
                Q1 = _mm512_dpwssd_epi32(Q1, W1[c + 1], X1);
            }
            if (b == 0) {
                q_k_int16_vnni_start(&A0[s]);
                q_k_int16_vnni_start(&A1[s]);
            }
            _mm512_store_ps(A0[s].a, _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(P0, Q0)), _mm512_set1_ps(d0 * xs->d), _mm512_load_ps(A0[s].a)));
            _mm512_store_ps(A1[s].a, _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(P1, Q1)), _mm512_set1_ps(d1 * xs->d), _mm512_load_ps(A1[s].a)));
            if (type != T_Q6_K) {
                __m256i bs = _mm256_loadu_si256((const __m256i *)xs->bsums);
                _mm256_store_ps(A0[s].m, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_mullo_epi32(mins0, bs)), _mm256_set1_ps(f0 * xs->d), _mm256_load_ps(A0[s].m)));
                _mm256_store_ps(A1[s].m, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_mullo_epi32(mins1, bs)), _mm256_set1_ps(f1 * xs->d), _mm256_load_ps(A1[s].m)));
            }
        }
    }
}

static VNNI_TARGET void q_k_int16_vnni_pair_row(int type, const uint8_t *row0, const uint8_t *row1, const struct block_q16_k *x, int64_t ldx,
                                     int nb, int S, struct i8acc *A0, struct i8acc *A1) {
    switch (type) {
    case T_Q4_K: q_k_int16_vnni_pair(T_Q4_K, row0, row1, x, ldx, nb, S, A0, A1); break;
    case T_Q5_K: q_k_int16_vnni_pair(T_Q5_K, row0, row1, x, ldx, nb, S, A0, A1); break;
    case T_Q6_K: q_k_int16_vnni_pair(T_Q6_K, row0, row1, x, ldx, nb, S, A0, A1); break;
    }
}

static INLINE VNNI_TARGET void q_k_int16_vnni(const int type, const uint8_t *row, const struct block_q16_k *x, int64_t ldx, int nb,
                                        int S, struct i8acc *A) {
    const int bb = block_bytes(type);
    __m512i index[8];
    q_k_int16_vnni_index(type, index);
    for (int b = 0; b < nb; b++) {
        __m512i W[8];
        __m256i mins;
        float d, f;
        q_k_int16_vnni_widen(type, row + (int64_t)b * bb, index, W, &d, &f, &mins);
        for (int s = 0; s < S; s++) {
            const struct block_q16_k *xs = x + s * ldx + b;
            __m512i V0 = _mm512_setzero_si512(), V1 = V0;
            for (int c = 0; c < 8; c += 2) {
                V0 = _mm512_dpwssd_epi32(V0, W[c], _mm512_loadu_si512((const void *)(xs->qs + 32 * c)));
                V1 = _mm512_dpwssd_epi32(V1, W[c + 1], _mm512_loadu_si512((const void *)(xs->qs + 32 * c + 32)));
            }
            __m512i V = _mm512_add_epi32(V0, V1);
            if (b == 0) q_k_int16_vnni_start(&A[s]);
            _mm512_store_ps(A[s].a, _mm512_fmadd_ps(_mm512_cvtepi32_ps(V), _mm512_set1_ps(d * xs->d), _mm512_load_ps(A[s].a)));
            if (type != T_Q6_K) {
                __m256i M = _mm256_mullo_epi32(mins, _mm256_loadu_si256((const __m256i *)xs->bsums));
                _mm256_store_ps(A[s].m, _mm256_fmadd_ps(_mm256_cvtepi32_ps(M), _mm256_set1_ps(f * xs->d), _mm256_load_ps(A[s].m)));
            }
        }
    }
}

static VNNI_TARGET void q_k_int16_vnni_row(int type, const uint8_t *row, const struct block_q16_k *x, int64_t ldx, int nb, int S,
                                    struct i8acc *A) {
    switch (type) {
    case T_Q4_K: q_k_int16_vnni(T_Q4_K, row, x, ldx, nb, S, A); break;
    case T_Q5_K: q_k_int16_vnni(T_Q5_K, row, x, ldx, nb, S, A); break;
    case T_Q6_K: q_k_int16_vnni(T_Q6_K, row, x, ldx, nb, S, A); break;
    }
}
#endif

/* Rows from which outputs go two at a time on the VNNI path (q_k_int16_vnni_pair): each
 * activation load then feeds two outputs, which pays from a verification's rows on, not for
 * fewer (`bench.kernel_ab`, one output at a time as the base, on a 1B Q4_K_M file). */
#define I16_PAIRS_FROM 7

/* Activation rows sharing each widened super-block (and a group of a many-row product). */
#define I16_ROWS 32

/* Output row `at` (p->ld bytes: a row a few ahead of the one being worked) asked for. Q6_K's
 * rows (half as many lines again as Q4_K's) went into the first level in a burst that stalled
 * on the queue of misses: they go into the second, Q4_K's into the first (alike either way).
 * Inlined: as a call it slowed the row loop. */
static INLINE void row_ahead(const struct part *p, const uint8_t *at) {
    if (p->type == T_Q6_K)
        for (int64_t b = 0; b < p->ld; b += 64) __builtin_prefetch(at + b, 0, 2);
    else
        for (int64_t b = 0; b < p->ld; b += 64) __builtin_prefetch(at + b, 0, 3);
}

/* Outputs [r0, r1) of one part (a 256-weight type) against all S rows: y[s * ldy + r]. */
static void q_k_int16_outputs(const struct part *p, int64_t r0, int64_t r1, const struct block_q16_k *xw, int S, int K, float *y,
                          int64_t ldy, int path) {
    int nb = K / 256;
    int64_t ldx = nb;
    struct i8acc A[I16_ROWS], A2[I16_ROWS];
    int64_t r = r0;
#ifdef I8_X86
    if (path == INT8_AVX512_VNNI && S >= I16_PAIRS_FROM)  /* two outputs at a time (q_k_int16_vnni_pair) */
        for (; r + 2 <= r1; r += 2) {
            const uint8_t *row = (const uint8_t *)p->data + r * p->ld;
            for (int64_t ahead = r + PREFETCH_ROWS; ahead < r + PREFETCH_ROWS + 2 && ahead < p->rows; ahead++)
                row_ahead(p, (const uint8_t *)p->data + ahead * p->ld);
            for (int s0 = 0; s0 < S; s0 += I16_ROWS) {
                int g = S - s0 < I16_ROWS ? S - s0 : I16_ROWS;
                q_k_int16_vnni_pair_row(p->type, row, row + p->ld, xw + s0 * ldx, ldx, nb, g, A, A2);
                for (int s = 0; s < g; s++) {
                    y[(int64_t)(s0 + s) * ldy + r] = i8_result(&A[s]);
                    y[(int64_t)(s0 + s) * ldy + r + 1] = i8_result(&A2[s]);
                }
            }
        }
#endif
    for (; r < r1; r++) {
        const uint8_t *row = (const uint8_t *)p->data + r * p->ld;
        if (r + PREFETCH_ROWS < p->rows) row_ahead(p, row + PREFETCH_ROWS * p->ld);
        for (int s0 = 0; s0 < S; s0 += I16_ROWS) {
            int g = S - s0 < I16_ROWS ? S - s0 : I16_ROWS;
            const struct block_q16_k *xs = xw + s0 * ldx;
            if (path != INT8_AVX512_VNNI) memset(A, 0, sizeof(A[0]) * (size_t)g);  /* the VNNI kernels start their lanes */
            switch (path) {
#ifdef I8_X86
            case INT8_AVX512_VNNI: q_k_int16_vnni_row(p->type, row, xs, ldx, nb, g, A); break;
            case INT8_AVX2: q_k_int16_avx2_row(p->type, row, xs, ldx, nb, g, A); break;
#endif
            default: q_k_int16_ref(p->type, row, xs, ldx, nb, g, A); break;
            }
            for (int s = 0; s < g; s++) y[(int64_t)(s0 + s) * ldy + r] = i8_result(&A[s]);
        }
    }
}
