/* Few-row attention over a 16-bit integer cache, in integer arithmetic: the same bits on the
 * tiles (AMX-INT8) for many rows, on VNNI for a step, and in plain C. Included by attention.c,
 * whose jobs, softmax and merge it shares.
 *
 * Why. Over a float16 cache every query row costs its own float32 multiply-adds, and seven
 * rows (a verification) cost about seven times a step's. Integer products are exact, so a
 * tile product of 16 rows and a step's VNNI products of 4 give the same sums, and the tiles'
 * cost hardly grows with the rows.
 *
 * The cache. Each key and value vector (one token, one KV head) is stored as int16 on a grid
 * of its own absmax (scale = absmax / 32767, float32, `sk`/`sv`), as two byte planes: its high
 * byte plus 128 and its low byte, both unsigned, so x = 256 (hi - 128) + lo: closer to float32
 * than a float16 cache (`bench.kv_formats`). The planes are laid out as the products read them:
 *   keys, per 16 tokens:  [plane 2][D / 4][16 tokens][4 dims]    (32 D bytes)
 *   values, per 4 tokens: [plane 2][D][4 tokens]                 (8 D bytes)
 * so 64 bytes of keys are 16 tokens' 4 dims (a tile's B row and a VNNI vector, lanes = keys),
 * and 64 bytes of values are 16 dims of 4 tokens (lanes = dims). A head's keys and values each
 * take `head_bytes`, covering the cache's capacity (a multiple of 64 tokens).
 *
 * The arithmetic, per row r (a query head of a token) and block of keys:
 *   1. the query (pre-scaled) on a 14-bit grid of its absmax, split q = 128 qh + ql
 *      (qh in [-64, 63], ql in [0, 127]);
 *   2. A = sum_d k_d qh_d, B = sum_d k_d ql_d, exact in int32 (|A|, |B| < 2^29 for D <= 256);
 *      score = (float)A * (128 c) + (float)B * c, c = sq sk (one fused multiply-add);
 *   3. the softmax of attention.c (its exponential, its sums, its chunk sums);
 *   4. p' = p sv[t], on a 14-bit grid of the row's largest in the block, split p = 128 ph + pl
 *      (both in [0, 127]);
 *   5. X = sum_t ph_t v_t, Y = sum_t pl_t v_t, exact in int32 for blocks of up to 256 keys;
 *      the block's output (float)X * (128 s) + (float)Y * s, s = the block's grid step;
 *   6. attention.c's merge.
 * Only 2 and 5 differ between the paths, and they give integers: a row equals itself whatever
 * rows share its call and whichever path ran it. The unsigned planes against signed parts are
 * what VNNI (u8 x s8) and the tiles' TDPBSUD multiply; the planes' +128 is taken back as
 * 32768 times the row's sum of parts.
 */
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define IAT_VNNI 1
#endif
#ifdef AMX_X86
#define IAT_TILES 1
#define IAT_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,amx-tile,amx-int8")))
#endif

#define IAT_Q 8191  /* the queries' grid: 14 bits */
#define IAT_P 16383 /* the weights': 14 bits of magnitude */
#define IAT_BLOCK 256 /* the most keys a block may hold: 5.'s sums stay in int32 */

enum { IAT_SCALAR = 0, IAT_VNNI_PATH = 1, IAT_TILES_PATH = 2 };

static int iat_tiles_state = -1;

/* Whether AMX's int8 tiles run in this process (asking for their state once). */
static int iat_tiles_run(void) {
    if (iat_tiles_state >= 0) return iat_tiles_state;
    int ok = 0;
#ifdef IAT_TILES
    unsigned a, b, c, d;
    ok = __get_cpuid_count(7, 0, &a, &b, &c, &d) && (b >> 16 & 1) && (b >> 30 & 1) && (b >> 31 & 1) &&
         amx_has(24) && amx_has(25) && amx_permitted(1);                /* AVX-512 F, BW, VL; AMX-TILE, -INT8 */
#endif
    iat_tiles_state = ok;
    return ok;
}

/* Which paths run here: bit 0 plain C, bit 1 VNNI, bit 2 the tiles. */
int integer_attention_paths(void) {
    int paths = 1;
#ifdef IAT_VNNI
    paths |= 2;
#endif
    if (iat_tiles_run()) paths |= 4;
    return paths;
}

/* Byte offsets of token t's hi plane, dim d, in a head's keys and values. */
static inline int64_t iat_key_at(int64_t t, int d, int D) { return t / 16 * 32 * D + (d / 4) * 64 + t % 16 * 4 + d % 4; }
static inline int64_t iat_value_at(int64_t t, int d, int D) { return t / 4 * 8 * D + d * 4 + t % 4; }

/* The integer whose high plane's byte is at `at`, its low plane's `low` bytes further. */
static inline int32_t iat_int(const uint8_t *planes, int64_t at, int64_t low) {
    return 256 * ((int32_t)planes[at] - 128) + planes[at + low];
}

/* The queries (pre-scaled) [H][R][D] as grids: qs [H][R] their steps, qb [H][2][R16][D] the
 * parts (0: qh, 1: ql; rows past R zero), qsum [H][2][R16] each part's sum over d. */
static void iat_queries(const float *q, int H, int R, int D, int R16, float *qs, int8_t *qb, int32_t *qsum) {
    memset(qb, 0, (size_t)H * 2 * R16 * D);
    memset(qsum, 0, sizeof(int32_t) * (size_t)H * 2 * R16);
    for (int h = 0; h < H; h++)
        for (int r = 0; r < R; r++) {
            const float *x = q + ((int64_t)h * R + r) * D;
            float top = 0.0f;
            for (int d = 0; d < D; d++) top = fabsf(x[d]) > top ? fabsf(x[d]) : top;
            float inv = top > 0.0f ? (float)IAT_Q / top : 0.0f;
            qs[h * R + r] = top / (float)IAT_Q;
            int8_t *hi = qb + (((int64_t)h * 2) * R16 + r) * D, *lo = hi + (int64_t)R16 * D;
            int32_t sh = 0, sl = 0;
            for (int d = 0; d < D; d++) {
                int v = (int)nearbyintf(x[d] * inv);
                v = v > IAT_Q ? IAT_Q : v < -IAT_Q ? -IAT_Q : v;
                hi[d] = (int8_t)(v >> 7);  /* floor: v = 128 hi + lo */
                lo[d] = (int8_t)(v & 127);
                sh += hi[d], sl += lo[d];
            }
            qsum[(h * 2) * R16 + r] = sh;
            qsum[(h * 2 + 1) * R16 + r] = sl;
        }
}

/* Step 2 on plain C: A and B [R][n16] of a head's keys from token t0 (n16 a multiple of 16). */
static void iat_scores_scalar(const int8_t *qb, const int32_t *qsum, int R, int R16, int D, const uint8_t *k,
                              int64_t t0, int n16, int32_t *A, int32_t *B, int ab) {
    (void)qsum;
    for (int r = 0; r < R; r++)
        for (int t = 0; t < n16; t++) {
            int32_t a = 0, b = 0;
            for (int d = 0; d < D; d++) {
                int32_t x = iat_int(k, iat_key_at(t0 + t, d, D), 16 * D);
                a += x * qb[(int64_t)r * D + d];
                b += x * qb[((int64_t)R16 + r) * D + d];
            }
            A[r * ab + t] = a, B[r * ab + t] = b;
        }
}

/* Step 5 on plain C: X and Y [R][D] over n64 values from token t0 (weights ph, pl [R16][pw]). */
static void iat_weighted_scalar(const int8_t *ph, const int8_t *pl, int pw, const int32_t *psum, int R, int R16, int D,
                                const uint8_t *v, int64_t t0, int n64, int32_t *X, int32_t *Y) {
    (void)psum, (void)R16;
    for (int r = 0; r < R; r++)
        for (int d = 0; d < D; d++) {
            int32_t x = 0, y = 0;
            for (int t = 0; t < n64; t++) {
                int32_t e = iat_int(v, iat_value_at(t0 + t, d, D), 4 * D);
                x += e * ph[(int64_t)r * pw + t];
                y += e * pl[(int64_t)r * pw + t];
            }
            X[r * D + d] = x, Y[r * D + d] = y;
        }
}

#if defined(IAT_VNNI) || defined(IAT_TILES)
/* A part's sums in each lane from its products with the two planes, the high plane's +128 taken
 * back: 256 hi_sum + lo_sum - 32768 (the part's sum over the lane's elements, `sum`). */
#define IAT_PLANES(hi_sum, lo_sum, sum) \
    _mm512_sub_epi32(_mm512_add_epi32(_mm512_slli_epi32(hi_sum, 8), lo_sum), _mm512_set1_epi32(32768 * (sum)))
#endif

#ifdef IAT_VNNI
/* The four products of a row's two parts (their 4 bytes broadcast: bh, bl) with the two planes. */
#define IAT_DP4(i, hi, lo, bh, bl)                   \
    hh[i] = _mm512_dpbusd_epi32(hh[i], hi, bh);      \
    lh[i] = _mm512_dpbusd_epi32(lh[i], lo, bh);      \
    hl[i] = _mm512_dpbusd_epi32(hl[i], hi, bl);      \
    ll[i] = _mm512_dpbusd_epi32(ll[i], lo, bl);

/* Step 2 on VNNI, up to 4 rows at a time: lanes are 16 keys, one u8 x s8 product per plane and
 * part, 4 dims a lane. */
static void iat_scores_vnni(const int8_t *qb, const int32_t *qsum, int R, int R16, int D, const uint8_t *k, int64_t t0,
                            int n16, int32_t *A, int32_t *B, int ab, Prefetch *pf) {
    for (int g = 0; g < n16; g += 16) {
        const uint8_t *kg = k + (t0 + g) / 16 * 32 * D;
        for (int r0 = 0; r0 < R; r0 += 4) {
            const int rows = R - r0 < 4 ? R - r0 : 4;
            __m512i hh[4], lh[4], hl[4], ll[4];
            for (int i = 0; i < 4; i++) hh[i] = lh[i] = hl[i] = ll[i] = _mm512_setzero_si512();
            for (int j = 0; j < D / 4; j++) {
                if ((j & 3) == 0) prefetch(pf);  /* a few lines at a time: a burst stalls on the queue */
                __m512i kh = _mm512_loadu_si512(kg + j * 64), kl = _mm512_loadu_si512(kg + 16 * D + j * 64);
                for (int i = 0; i < rows; i++) {
                    const int8_t *qr = qb + (int64_t)(r0 + i) * D;
                    __m512i bh = _mm512_set1_epi32(*(const int32_t *)(qr + 4 * j));
                    __m512i bl = _mm512_set1_epi32(*(const int32_t *)(qr + (int64_t)R16 * D + 4 * j));
                    IAT_DP4(i, kh, kl, bh, bl)
                }
            }
            for (int i = 0; i < rows; i++) {
                int r = r0 + i;
                _mm512_storeu_si512(A + r * ab + g, IAT_PLANES(hh[i], lh[i], qsum[r]));
                _mm512_storeu_si512(B + r * ab + g, IAT_PLANES(hl[i], ll[i], qsum[R16 + r]));
            }
        }
    }
}

/* Step 5 on VNNI: lanes are 16 dims, one product per plane and part, 4 tokens a lane. */
static void iat_weighted_vnni(const int8_t *ph, const int8_t *pl, int pw, const int32_t *psum, int R, int R16, int D,
                              const uint8_t *v, int64_t t0, int n64, int32_t *X, int32_t *Y, Prefetch *pf) {
    const uint8_t *vb = v + t0 / 4 * 8 * D;
    for (int c = 0; c < D; c += 16)
        for (int r0 = 0; r0 < R; r0 += 4) {
            const int rows = R - r0 < 4 ? R - r0 : 4;
            __m512i hh[4], lh[4], hl[4], ll[4];
            for (int i = 0; i < 4; i++) hh[i] = lh[i] = hl[i] = ll[i] = _mm512_setzero_si512();
            for (int g = 0; g < n64 / 4; g++) {
                prefetch(pf);
                const uint8_t *vq = vb + (int64_t)g * 8 * D + c * 4;
                __m512i vh = _mm512_loadu_si512(vq), vl = _mm512_loadu_si512(vq + 4 * D);
                for (int i = 0; i < rows; i++) {
                    __m512i bh = _mm512_set1_epi32(*(const int32_t *)(ph + (int64_t)(r0 + i) * pw + 4 * g));
                    __m512i bl = _mm512_set1_epi32(*(const int32_t *)(pl + (int64_t)(r0 + i) * pw + 4 * g));
                    IAT_DP4(i, vh, vl, bh, bl)
                }
            }
            for (int i = 0; i < rows; i++) {
                int r = r0 + i;
                _mm512_storeu_si512(X + r * D + c, IAT_PLANES(hh[i], lh[i], psum[r]));
                _mm512_storeu_si512(Y + r * D + c, IAT_PLANES(hl[i], ll[i], psum[R16 + r]));
            }
        }
}
#endif

#ifdef IAT_TILES
/* The four sums of a tile product (tiles 4-7: hi x qh-like, lo x qh, hi x ql, lo x ql) stored
 * and combined as the VNNI path combines them, rows r0.. of A and B (or X and Y). */
INLINE IAT_TARGET void iat_combine_tiles(int32_t *cbuf, const int32_t *sums, int R16, int r0, int R, int32_t *A,
                                          int32_t *B, int ab) {
    _tile_stored(4, cbuf, 64);
    _tile_stored(5, cbuf + 256, 64);
    _tile_stored(6, cbuf + 512, 64);
    _tile_stored(7, cbuf + 768, 64);
    for (int i = 0; i < 16 && r0 + i < R; i++) {
        int r = r0 + i;
        __m512i hh = _mm512_load_si512(cbuf + i * 16), lh = _mm512_load_si512(cbuf + 256 + i * 16);
        __m512i hl = _mm512_load_si512(cbuf + 512 + i * 16), ll = _mm512_load_si512(cbuf + 768 + i * 16);
        _mm512_storeu_si512(A + r * ab, IAT_PLANES(hh, lh, sums[r]));
        _mm512_storeu_si512(B + r * ab, IAT_PLANES(hl, ll, sums[R16 + r]));
    }
}

/* Step 2 on the tiles: C (16 rows x 16 keys) = the query part's rows (A, s8) x the key plane's
 * 16 tokens (B, u8), 64 dims a product. A group's keys are loaded once for every row tile. */
static IAT_TARGET void iat_scores_tiles(const int8_t *qb, const int32_t *qsum, int R, int R16, int D, const uint8_t *k,
                                        int64_t t0, int n16, int32_t *A, int32_t *B, int ab, int32_t *cbuf, Prefetch *pf) {
    for (int g = 0; g < n16; g += 16) {
        const uint8_t *kg = k + (t0 + g) / 16 * 32 * D;
        for (int c = 0; c < R16; c += 16) {
            const int8_t *qh = qb + (int64_t)c * D, *ql = qb + ((int64_t)R16 + c) * D;
            prefetch(pf);
            _tile_zero(4);
            _tile_zero(5);
            _tile_zero(6);
            _tile_zero(7);
            for (int j = 0; j < D / 64; j++) {
                if (c == 0 || D != 64) {
                    _tile_loadd(2, kg + j * 1024, 64);
                    _tile_loadd(3, kg + 16 * D + j * 1024, 64);
                }
                _tile_loadd(0, qh + j * 64, D);
                _tile_loadd(1, ql + j * 64, D);
                _tile_dpbsud(4, 0, 2);
                _tile_dpbsud(5, 0, 3);
                _tile_dpbsud(6, 1, 2);
                _tile_dpbsud(7, 1, 3);
            }
            prefetch(pf);
            iat_combine_tiles(cbuf, qsum, R16, c, R, A + g, B + g, ab);
        }
    }
}

/* Step 5 on the tiles: C (16 rows x 16 dims) = the weights' rows (A, s8, 64 tokens) x the value
 * plane's 16 quads of tokens (B, u8). */
static IAT_TARGET void iat_weighted_tiles(const int8_t *ph, const int8_t *pl, int pw, const int32_t *psum, int R, int R16,
                                          int D, const uint8_t *v, int64_t t0, int n64, int32_t *X, int32_t *Y,
                                          int32_t *cbuf, Prefetch *pf) {
    const uint8_t *vb = v + t0 / 4 * 8 * D;
    /* the row tiles inside: each takes 16 dims' values of the block (8 KB) from the level-1
       cache after the first */
    for (int dc = 0; dc < D; dc += 16)
        for (int c = 0; c < R16; c += 16) {
            _tile_zero(4);
            _tile_zero(5);
            _tile_zero(6);
            _tile_zero(7);
            for (int s = 0; s < n64; s += 64) {
                prefetch(pf);
                _tile_loadd(0, ph + (int64_t)c * pw + s, pw);
                _tile_loadd(1, pl + (int64_t)c * pw + s, pw);
                const uint8_t *vq = vb + (int64_t)s / 4 * 8 * D + dc * 4;
                _tile_loadd(2, vq, 8 * D);
                _tile_loadd(3, vq + 4 * D, 8 * D);
                _tile_dpbsud(4, 0, 2);
                _tile_dpbsud(5, 0, 3);
                prefetch(pf);
                _tile_dpbsud(6, 1, 2);
                _tile_dpbsud(7, 1, 3);
            }
            iat_combine_tiles(cbuf, psum, R16, c, R, X + dc, Y + dc, D);
        }
}
#endif

/* The floats of integer sums: f[i] = (float)x[i] * (128 c) + (float)y[i] * c, one fused
 * multiply-add, c = scale times cs[i] (cs NULL: 1). The vector lanes and the scalar tail do the
 * same operations, so every element gets the same bits whichever ran it. */
static void iat_floats_scaled(const int32_t *x, const int32_t *y, float scale, const float *cs, int n, float *f) {
    int i = 0;
#ifdef __AVX512F__
    for (; i + 16 <= n; i += 16) {
        __m512 c = cs ? _mm512_mul_ps(_mm512_set1_ps(scale), _mm512_loadu_ps(cs + i)) : _mm512_set1_ps(scale);
        __m512 fy = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_loadu_si512(y + i)), c);
        _mm512_storeu_ps(f + i, _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_loadu_si512(x + i)),
                                                _mm512_mul_ps(c, _mm512_set1_ps(128.0f)), fy));
    }
#endif
    for (; i < n; i++) {
        float c = cs ? scale * cs[i] : scale;
        f[i] = fmaf((float)x[i], c * 128.0f, (float)y[i] * c);
    }
}

/* A block's output row: step 5's floats, c = the weights' step. */
static void iat_floats(const int32_t *x, const int32_t *y, float sp, int D, float *o) {
    iat_floats_scaled(x, y, sp, NULL, D, o);
}

/* Steps 2's floats, 3 and 4 for one row of a block, in three passes over its n keys:
 *   1. the scores from the integer sums a and b (as iat_floats_scaled forms them), and the max m
 *      of the `seen` the row sees;
 *   2. e = exp(s - m) for those (zero past them, into s), their sum l, each whole chunk's sum
 *      (cs: the row's sums from this block's first chunk, `chunks` of them; NULL: none), and the
 *      largest e sv;
 *   3. e sv on a 14-bit grid of that largest, as parts ph and pl [n64] (zero past n) and the
 *      parts' sums.
 * Returns the grid's step; m and l at *m_out and *l_out (m = -inf, l = 0 for a row that sees
 * none of the block). The same operations whatever the path and the rows beside it. */
static float iat_row(const int32_t *a, const int32_t *b, float sq, const float *sk, const float *sv, int n, int seen,
                     int n64, float *s, int8_t *ph, int8_t *pl, int32_t *sh, int32_t *sl, float *m_out, float *l_out,
                     int chunk, float *cs, int64_t chunks) {
    float m = -INFINITY, l = 0.0f, top = 0.0f;
    int32_t hsum = 0, lsum = 0;
#ifdef __AVX512F__
    const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    __m512 mv = _mm512_set1_ps(-INFINITY);
    for (int t = 0; t < n; t += 16) {
        __mmask16 in = _mm512_cmplt_epi32_mask(lane, _mm512_set1_epi32(n - t));
        __m512 c = _mm512_mul_ps(_mm512_set1_ps(sq), _mm512_maskz_loadu_ps(in, sk + t));
        __m512 fy = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_maskz_loadu_epi32(in, b + t)), c);
        __m512 sc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_maskz_loadu_epi32(in, a + t)),
                                    _mm512_mul_ps(c, _mm512_set1_ps(128.0f)), fy);
        _mm512_mask_storeu_ps(s + t, in, sc);
        mv = _mm512_mask_max_ps(mv, _mm512_cmplt_epi32_mask(lane, _mm512_set1_epi32(seen - t)), mv, sc);
    }
    m = seen > 0 ? _mm512_reduce_max_ps(mv) : -INFINITY;
    __m512 lv = _mm512_setzero_ps(), tv = _mm512_setzero_ps();
    for (int t = 0; t < n; t += 16) {
        __mmask16 in = _mm512_cmplt_epi32_mask(lane, _mm512_set1_epi32(n - t));
        __mmask16 vis = _mm512_cmplt_epi32_mask(lane, _mm512_set1_epi32(seen - t));
        __m512 e = seen > 0 ? _mm512_maskz_mov_ps(vis, exp_nonpositive_16(_mm512_sub_ps(_mm512_maskz_loadu_ps(vis, s + t),
                                                                                          _mm512_set1_ps(m))))
                            : _mm512_setzero_ps();
        _mm512_mask_storeu_ps(s + t, in, e);
        lv = _mm512_add_ps(lv, e);
        tv = _mm512_max_ps(tv, _mm512_mul_ps(e, _mm512_maskz_loadu_ps(in, sv + t)));
    }
    float lanes[16];
    _mm512_storeu_ps(lanes, lv);
    for (int j = 0; j < 16; j++) l += lanes[j];
    top = _mm512_reduce_max_ps(tv);
#else
    for (int t = 0; t < n; t++) {
        float c = sq * sk[t];
        s[t] = fmaf((float)a[t], c * 128.0f, (float)b[t] * c);
        if (t < seen) m = s[t] > m ? s[t] : m;
    }
    for (int t = 0; t < n; t++) {
        s[t] = t < seen ? exp_nonpositive(s[t] - m) : 0.0f;
        l += s[t];
        float x = s[t] * sv[t];
        top = x > top ? x : top;
    }
#endif
    if (cs)
        for (int64_t c = 0; c < chunks && c * chunk < n; c++) {
            float acc = 0.0f;
            for (int t = (int)c * chunk; t < (c + 1) * chunk; t++) acc += s[t];
            cs[c] = acc;
        }
    float inv = top > 0.0f ? (float)IAT_P / top : 0.0f;
    int t = 0;
#ifdef __AVX512F__
    __m512i hv = _mm512_setzero_si512(), wv = _mm512_setzero_si512();
    for (; t < n64; t += 16) {
        __mmask16 in = _mm512_cmplt_epi32_mask(lane, _mm512_set1_epi32(n - t));
        __m512 x = _mm512_mul_ps(_mm512_mul_ps(_mm512_maskz_loadu_ps(in, s + t), _mm512_maskz_loadu_ps(in, sv + t)),
                                 _mm512_set1_ps(inv));
        __m512i xi = _mm512_min_epi32(_mm512_max_epi32(_mm512_cvtps_epi32(x), _mm512_setzero_si512()),
                                      _mm512_set1_epi32(IAT_P));
        __m512i xh = _mm512_srai_epi32(xi, 7), xl = _mm512_and_si512(xi, _mm512_set1_epi32(127));
        _mm_storeu_si128((__m128i *)(ph + t), _mm512_cvtepi32_epi8(xh));
        _mm_storeu_si128((__m128i *)(pl + t), _mm512_cvtepi32_epi8(xl));
        hv = _mm512_add_epi32(hv, xh), wv = _mm512_add_epi32(wv, xl);
    }
    hsum = _mm512_reduce_add_epi32(hv), lsum = _mm512_reduce_add_epi32(wv);
#else
    for (; t < n; t++) {
        int x = (int)nearbyintf(s[t] * sv[t] * inv);  /* to nearest, ties to even: as cvtps_epi32 */
        x = x > IAT_P ? IAT_P : x < 0 ? 0 : x;
        ph[t] = (int8_t)(x >> 7), pl[t] = (int8_t)(x & 127);
        hsum += ph[t], lsum += pl[t];
    }
    for (; t < n64; t++) ph[t] = pl[t] = 0;
#endif
    *sh = hsum, *sl = lsum, *m_out = m, *l_out = l;
    return top / (float)IAT_P;
}

/* Steps 2-5 for the jobs [job_begin, job_end) on `path`; outputs as `blocks`'. */
static int iat_blocks(const float *qs, const int8_t *qb, const int32_t *qsum, const uint8_t *k, const uint8_t *v,
                      const float *sk, const float *sv, int64_t head_bytes, int64_t scale_stride, int H, int R, int R16,
                      int D, int64_t T, const int64_t *limit, int block, int64_t job_begin, int64_t job_end, float *out,
                      float *m_out, float *l_out, int chunk, float *chunk_sum, int path) {
    (void)H;
    int64_t nb = (T + block - 1) / block;
    const int B64 = (block + 63) / 64 * 64;
    /* per thread: scores [R][B64], A and B [R16][B64] (tiles write 16 rows), the weights' parts
       [R16][B64] twice, X and Y [R16][D], the tiles' four sums */
    size_t bytes = sizeof(float) * (size_t)R * B64 + sizeof(int32_t) * (size_t)R16 * B64 * 2 + (size_t)R16 * B64 * 2 +
                   sizeof(int32_t) * (size_t)R16 * D * 2 + sizeof(int32_t) * 1024 + sizeof(int32_t) * 2 * R16 + 64 * 8;
    char *scratch = aligned_alloc(64, (bytes + 63) / 64 * 64);
    if (!scratch) return -1;
    int32_t *cbuf = (int32_t *)scratch;
    float *s = (float *)(cbuf + 1024);
    int32_t *A = (int32_t *)(s + (size_t)R * B64), *B = A + (size_t)R16 * B64;
    int32_t *X = B + (size_t)R16 * B64, *Y = X + (size_t)R16 * D, *psum = Y + (size_t)R16 * D;
    int8_t *ph = (int8_t *)(psum + 2 * R16), *pl = ph + (size_t)R16 * B64;
    float *ps = malloc(sizeof(float) * (size_t)R);
    if (!ps) {
        free(scratch);
        return -1;
    }
    memset(ph, 0, (size_t)R16 * B64 * 2);
#ifdef IAT_TILES
    if (path == IAT_TILES_PATH) amx_configure();
#endif
    int64_t n_chunks = chunk > 0 ? T / chunk : 0;
    for (int64_t job = job_begin; job < job_end; job++) {
        int64_t h = job / nb, b = job % nb, t0 = b * block;
        int n = (int)((T - t0) < block ? (T - t0) : block), n16 = (n + 15) / 16 * 16, n64 = (n + 63) / 64 * 64;
        const uint8_t *kh = k + h * head_bytes, *vh = v + h * head_bytes;
        const float *skh = sk + h * scale_stride + t0, *svh = sv + h * scale_stride + t0;
        const int8_t *qbh = qb + (int64_t)h * 2 * R16 * D;
        const int32_t *qsh = qsum + (int64_t)h * 2 * R16;
        const float *qsr = qs + h * R;
        /* the next job's keys and values are asked for into the level-2 cache while this one is
           worked (as attention.c does), spread over the products' passes */
        Prefetch pk = {NULL, NULL, 0, 0}, pv = {NULL, NULL, 0, 0};
        if (job + 1 < job_end) {
            int64_t h1 = (job + 1) / nb, t1 = (job + 1) % nb * block;
            int n1 = (int)((T - t1) < block ? (T - t1) : block);
            int64_t kb = (int64_t)(n1 + 15) / 16 * 32 * D, vb = (int64_t)(n1 + 3) / 4 * 8 * D;
            int rows = path == IAT_TILES_PATH ? R16 / 16 : (R + 3) / 4;
            /* the products' calls of `prefetch` in this job */
            int64_t kc = path == IAT_TILES_PATH ? (int64_t)n16 / 16 * rows * 2 : (int64_t)n16 / 16 * rows * (D / 16);
            int64_t vc = path == IAT_TILES_PATH ? (int64_t)rows * (D / 16) * (n64 / 64) * 2 : (int64_t)(D / 16) * rows * (n64 / 4);
            pk = (Prefetch){(const char *)(k + h1 * head_bytes + t1 / 16 * 32 * D), NULL, 0, 0};
            pk.end = pk.next + kb, pk.step = (kb / kc + 63) / 64 * 64;
            pv = (Prefetch){(const char *)(v + h1 * head_bytes + t1 / 4 * 8 * D), NULL, 0, 0};
            pv.end = pv.next + vb, pv.step = (vb / vc + 63) / 64 * 64;
        }
        /* 2. the scores' integer sums, then the scores */
#ifdef IAT_TILES
        if (path == IAT_TILES_PATH) iat_scores_tiles(qbh, qsh, R, R16, D, kh, t0, n16, A, B, B64, cbuf, &pk);
        else
#endif
#ifdef IAT_VNNI
        if (path == IAT_VNNI_PATH) iat_scores_vnni(qbh, qsh, R, R16, D, kh, t0, n16, A, B, B64, &pk);
        else
#endif
            iat_scores_scalar(qbh, qsh, R, R16, D, kh, t0, n16, A, B, B64);
        /* the next job's steps too (1 KB of each a block), here where the row passes below issue
           no loads of their own */
        if (job + 1 < job_end) {
            int64_t h1 = (job + 1) / nb, t1 = (job + 1) % nb * block;
            const char *s1 = (const char *)(sk + h1 * scale_stride + t1), *v1 = (const char *)(sv + h1 * scale_stride + t1);
            for (int64_t c = 0; c < (int64_t)block * 4; c += 64) {
                __builtin_prefetch(s1 + c, 0, 1);
                __builtin_prefetch(v1 + c, 0, 1);
            }
        }
        /* 3-4. per row: the scores, the softmax, the weights on their grid */
        int64_t stat = (h * nb + b) * R;
        for (int r = 0; r < R; r++) {
            int64_t lim = (limit ? limit[r] : T) - t0;
            int seen = lim <= 0 ? 0 : (lim < n ? (int)lim : n);
            int64_t first = chunk > 0 ? t0 / chunk : 0, chunks = first < n_chunks ? n_chunks - first : 0;
            float *cs = chunk_sum && chunks ? chunk_sum + (h * R + r) * n_chunks + first : NULL;
            ps[r] = iat_row(A + r * B64, B + r * B64, qsr[r], skh, svh, n, seen, n64, s + (int64_t)r * B64,
                            ph + (int64_t)r * B64, pl + (int64_t)r * B64, psum + r, psum + R16 + r, m_out + stat + r,
                            l_out + stat + r, chunk, cs, chunks);
        }
        /* 5. the weighted sums' integers, then the block's output */
#ifdef IAT_TILES
        if (path == IAT_TILES_PATH) iat_weighted_tiles(ph, pl, B64, psum, R, R16, D, vh, t0, n64, X, Y, cbuf, &pv);
        else
#endif
#ifdef IAT_VNNI
        if (path == IAT_VNNI_PATH) iat_weighted_vnni(ph, pl, B64, psum, R, R16, D, vh, t0, n64, X, Y, &pv);
        else
#endif
            iat_weighted_scalar(ph, pl, B64, psum, R, R16, D, vh, t0, n64, X, Y);
        float *o = out + stat * D;
        for (int r = 0; r < R; r++) iat_floats(X + r * D, Y + r * D, ps[r], D, o + (int64_t)r * D);
    }
    free(ps);
    free(scratch);
    return 0;
}

/* The whole attention over an int16 cache (layout above): q [H][R][D] pre-scaled; sk, sv the
 * scales, head h's at h * scale_stride; `path` IAT_SCALAR, IAT_VNNI_PATH or IAT_TILES_PATH;
 * the rest as `attention`'s. Returns -1 when out of memory, -2 for a path that does not run
 * here, -3 for sizes the arithmetic does not cover (D not a multiple of 64 or above 256, a
 * block of more than IAT_BLOCK keys). */
int integer_attention(const float *q, const uint8_t *k, const uint8_t *v, const float *sk, const float *sv,
                      int64_t head_bytes, int64_t scale_stride, int H, int R, int D, int64_t T, const int64_t *limit,
                      int block, int threads, int path, float *out, float *m_out, float *l_out, int chunk,
                      float *chunk_sum, float *result) {
    if (D % 64 || D > 256 || block > IAT_BLOCK || block % 64 || R < 1) return -3;
    if (path < 0 || path > 2 || !(integer_attention_paths() >> path & 1)) return -2;
    const int R16 = (R + 15) / 16 * 16;
    float *qs = malloc(sizeof(float) * (size_t)H * R);
    int8_t *qb = malloc((size_t)H * 2 * R16 * D);
    int32_t *qsum = malloc(sizeof(int32_t) * (size_t)H * 2 * R16);
    int failed = !qs || !qb || !qsum;
    if (!failed) {
        iat_queries(q, H, R, D, R16, qs, qb, qsum);
        int64_t nb = (T + block - 1) / block, jobs = H * nb;
#ifdef _OPENMP
#pragma omp parallel num_threads(threads) reduction(| : failed)
        {
            int64_t n = omp_get_num_threads(), i = omp_get_thread_num();
            failed |= iat_blocks(qs, qb, qsum, k, v, sk, sv, head_bytes, scale_stride, H, R, R16, D, T, limit, block,
                                 jobs * i / n, jobs * (i + 1) / n, out, m_out, l_out, chunk, chunk_sum, path);
        }
#else
        (void)threads;
        failed = iat_blocks(qs, qb, qsum, k, v, sk, sv, head_bytes, scale_stride, H, R, R16, D, T, limit, block, 0,
                            jobs, out, m_out, l_out, chunk, chunk_sum, path);
#endif
        if (!failed) merge(H, R, D, nb, out, m_out, l_out, result, T, block, chunk, chunk > 0 ? chunk_sum : NULL, threads);
    }
    free(qs);
    free(qb);
    free(qsum);
    return failed ? -1 : 0;
}

/* Step 0, the cache's own: tokens' keys and values [H][n][D] float (head h's token i at
 * h * xh + i * xt floats, its D numbers contiguous: a prefill's transposed views need no copy)
 * onto their grids, written as the tokens start.. of each head (planes and scales as
 * `integer_attention` reads them).
 * The arithmetic of int16_kv.on_grid, which the tests hold it to bit for bit: the step is
 * absmax / 32767, the factor (1 / absmax) * 32767 (PyTorch's scalar-over-tensor division),
 * each element rounded to nearest even; a zero vector gets step and integers 0, a NaN the
 * integer -32767. Bounds are the caller's (native_attention.Kernel.integer_write). */
static void iat_write_heads(const float *x, int64_t xh, int64_t xt, int H, int64_t n, int D, int64_t start,
                            uint8_t *planes, float *steps, int64_t head_bytes, int64_t scale_stride, int values) {
    const int64_t low = values ? 4 * D : 16 * D;
    for (int h = 0; h < H; h++)
        for (int64_t i = 0; i < n; i++) {
            const float *row = x + h * xh + i * xt;
            float top = 0.0f;
            for (int d = 0; d < D; d++) top = fabsf(row[d]) > top ? fabsf(row[d]) : top;
            const int64_t t = start + i;
            steps[h * scale_stride + t] = top / 32767.0f;
            const float inv = top > 0.0f ? (1.0f / top) * 32767.0f : 0.0f;
            uint8_t *p = planes + h * head_bytes;
            for (int d = 0; d < D; d++) {
                float r = nearbyintf(row[d] * inv);
                r = r > 32767.0f ? 32767.0f : r;
                r = r >= -32767.0f ? r : -32767.0f;
                const int32_t v = (int32_t)r;
                const int64_t at = values ? iat_value_at(t, d, D) : iat_key_at(t, d, D);
                p[at] = (uint8_t)((v >> 8) + 128);
                p[at + low] = (uint8_t)(v & 255);
            }
        }
}

int integer_write_strided(const float *k, int64_t kh, int64_t kt, const float *v, int64_t vh, int64_t vt, int H,
                          int64_t n, int D, int64_t start, uint8_t *kp, uint8_t *vp, float *sk, float *sv,
                          int64_t head_bytes, int64_t scale_stride) {
    if (D % 64 || D > 256 || n < 0 || start < 0) return -3;
    iat_write_heads(k, kh, kt, H, n, D, start, kp, sk, head_bytes, scale_stride, 0);
    iat_write_heads(v, vh, vt, H, n, D, start, vp, sv, head_bytes, scale_stride, 1);
    return 0;
}

/* The same, contiguous (decode_layers' writer). */
int integer_write(const float *k, const float *v, int H, int64_t n, int D, int64_t start, uint8_t *kp, uint8_t *vp,
                  float *sk, float *sv, int64_t head_bytes, int64_t scale_stride) {
    return integer_write_strided(k, (int64_t)n * D, D, v, (int64_t)n * D, D, H, n, D, start, kp, vp, sk, sv, head_bytes,
                                 scale_stride);
}

/* What the cache holds for tokens index[h][i] (i < n) of each head, as float32 (the integer
 * times its step): k_out, v_out [H][n][D]. For prefill's float attention and the retrieval
 * level's copies. Indices are the caller's to check (each below the cached length). */
int integer_tokens(const uint8_t *kp, const uint8_t *vp, const float *sk, const float *sv, int64_t head_bytes,
                   int64_t scale_stride, int H, int D, const int64_t *index, int64_t n, float *k_out, float *v_out,
                   int threads) {
    if (D % 64 || D > 256 || n < 0) return -3;
    (void)threads;
#ifdef _OPENMP
#pragma omp parallel for num_threads(threads) collapse(2) schedule(static) if ((int64_t)H * n * D > (1 << 16))
#endif
    for (int h = 0; h < H; h++)
        for (int64_t i = 0; i < n; i++) {
            const int64_t t = index[(int64_t)h * n + i];
            const uint8_t *kh = kp + h * head_bytes, *vh = vp + h * head_bytes;
            const float ks = sk[h * scale_stride + t], vs = sv[h * scale_stride + t];
            float *ko = k_out + ((int64_t)h * n + i) * D, *vo = v_out + ((int64_t)h * n + i) * D;
            for (int d = 0; d < D; d++) {
                ko[d] = (float)iat_int(kh, iat_key_at(t, d, D), 16 * D) * ks;
                vo[d] = (float)iat_int(vh, iat_value_at(t, d, D), 4 * D) * vs;
            }
        }
    return 0;
}
