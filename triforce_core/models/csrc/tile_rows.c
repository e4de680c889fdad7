/* A prefill's products of the 256-weight types (Q4_K, Q5_K, Q6_K) on AMX tiles: `int8.TILES`.
 *
 * Why a prefill only: a prefill multiplies every weight by hundreds of rows, where AMX's tile
 * products (a 16 x 16 block of int32 sums over 64 bytes in one instruction) leave the vector
 * units only the bookkeeping. A step or a verification keeps int16_rows.c's order: their rows
 * must equal each other bit for bit, and the tiles' sums do not come out in that order's lanes.
 * A prefill's rows only have to be the same whatever rows come with them, which these are
 * (each row quantized on its own, every output in one order).
 *
 * The activations are int16_rows.c's (struct block_q16_k, the same quantization), each q split
 * exactly into q = 256 hi + lo, hi signed (-128..127), lo unsigned (0..255). A weight times its
 * sub-block's integer scale, W (int16_rows.c's: Q4_K sc w, 0..945; Q5_K 0..1,953; Q6_K
 * sc (w - 32), -3,968..4,096), is split the same way: W = 256 Wh + Wl, Wh signed (-16..16), Wl
 * 0..255. With the scale inside the weights, a super-block's 256 products sum in one tile
 * accumulator each, no store per sub-block:
 *   C_hh = sum of hi Wh, C_hl = sum of hi Wl, C_lh = sum of lo Wh, C_ll = sum of lo Wl
 *          (over the super-block's 256 inputs; exact, each below 2^24 in magnitude: C_ll <= 256 x 255 x 255)
 *   F    = ((float)C_hh * 65536 + (float)C_hl * 256) + ((float)C_lh * 256 + (float)C_ll)
 *          (the conversions and the products by powers of two exact; three roundings, in this order)
 *   acc  = fmaf(F, d_n * d_m, acc)
 *   M    = sum of m_j bsum_j over the sub-blocks j    exact: < 8 x 63 x 32 x 32767 < 2^31
 *   mac  = fmaf((float)M, dmin_n * d_m, mac)            (Q4_K, Q5_K; Q6_K has no minimums)
 * per output n, row m and super-block b, in that order (the scalar reference `ref_tile_block`,
 * which the tile path follows); the output is acc - mac. On the tiles, per 64 inputs, four
 * products of 16 rows by 16 outputs: hi x Wl (tdpbsud), lo x Wl (tdpbuud), hi x Wh (tdpbssd),
 * lo x Wh (tdpbusd).
 * The weights are laid out as the tiles take them (four consecutive inputs of each of 16 outputs
 * a 64-byte row), gathered, scaled and split once a super-block for all of a group's rows.
 *
 * `tiles_ready` asks once whether the process may run them (amx.c: cpuid, XCR0, arch_prctl).
 *
 * Included by layers.c after int16_rows.c and amx.c.
 */

#ifdef AMX_X86
#define TILES_X86 1
#define TILE_TARGET __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,amx-tile,amx-int8")))
#endif

#define TILE_M 16      /* rows of a tile product */
#define TILE_GROUP 256 /* the most rows sharing one super-block's weights in tiles (a multiple of TILE_M) */

/* Rows a group takes for K inputs: the most (a multiple of TILE_M, at most TILE_GROUP) whose
 * activations (two bytes an input) fit 1 MB, so they stay in the second-level cache while every
 * output's weights stream past them; each output's weights are gathered and split once a group. */
static inline int tile_group(int K) {
    int rows = (1 << 20) / (2 * K) / TILE_M * TILE_M;
    return rows < TILE_M ? TILE_M : rows > TILE_GROUP ? TILE_GROUP : rows;
}

/* A prefill's rows as the tiles take them: S_pad = S rounded up to TILE_M rows (the rest zero). */
struct tile_acts {
    int8_t *hi;     /* [K / 64, S_pad, 64]: q >> 8, each 64 inputs' rows together (a tile's 16 rows are 1 KB in a row) */
    uint8_t *lo;    /* [K / 64, S_pad, 64]: q & 255 */
    int32_t *bsums; /* [S_pad, K / 256, 8]: sum of q per 32 inputs */
    float *d;       /* [S_pad, K / 256]: the block's scale */
    int S_pad;
    int steps;      /* 1: the steps' order (the kernel of `int8.STEP_TILES` below), 0: a prefill's */
    uint8_t *st;    /* with steps, the rows as that kernel's A tiles (`step_acts`) */
    float *fb;      /* with steps, bsums as floats (exact: |bsum| <= 32 x 32767), for the minimums' products
                       to broadcast from memory (converting them there was 6 % of a 7-row product) */
};

static void tile_acts_free(struct tile_acts *a) {
    free(a->st);
    free(a->fb);
    free(a->hi);
    free(a->lo);
    free(a->bsums);
    free(a->d);
}

/* Where input e of super-block b of row s is in a's hi and lo. */
static inline int64_t tile_at(const struct tile_acts *a, int s, int b, int e) {
    return ((int64_t)(4 * b + e / 64) * a->S_pad + s) * 64 + e % 64;
}

/* Row s of xw (K / 256 blocks) into a's row s. */
static void tile_acts_row_ref(const struct block_q16_k *xw, int K, int s, struct tile_acts *a) {
    int nb = K / 256;
    for (int b = 0; b < nb; b++) {
        const struct block_q16_k *x = xw + (int64_t)s * nb + b;
        for (int e = 0; e < 256; e++) {
            int q = q16_at(x, e);
            int64_t at = tile_at(a, s, b, e);
            a->hi[at] = (int8_t)(q >> 8); /* floor: q = 256 hi + lo exactly */
            a->lo[at] = (uint8_t)(q & 255);
        }
        memcpy(a->bsums + ((int64_t)s * nb + b) * 8, x->bsums, 8 * sizeof(int32_t));
        a->d[(int64_t)s * nb + b] = x->d;
    }
}

#ifdef TILES_X86
/* tile_acts_row_ref in AVX-512, the same bytes: each 64 inputs' evens and odds interleaved back
 * into their order, then the high and the low byte of each (a prefill's 1,024 rows spent a
 * quarter of the tiles' time in the scalar loop). */
static VNNI_TARGET void vnni_tile_acts_row(const struct block_q16_k *xw, int K, int s, struct tile_acts *a) {
    int nb = K / 256;
    __m512i first, second;
    {
        int16_t f[32], g[32];
        for (int i = 0; i < 32; i++) f[i] = (int16_t)((i & 1) * 32 + i / 2), g[i] = (int16_t)((i & 1) * 32 + 16 + i / 2);
        first = _mm512_loadu_si512((const void *)f);   /* natural 0..31 from (evens | odds) */
        second = _mm512_loadu_si512((const void *)g);  /* natural 32..63 */
    }
    const __m512i low = _mm512_set1_epi16(255);
    for (int b = 0; b < nb; b++) {
        const struct block_q16_k *x = xw + (int64_t)s * nb + b;
        for (int c = 0; c < 4; c++) {
            __m512i ev = _mm512_loadu_si512((const void *)(x->qs + 64 * c)), od = _mm512_loadu_si512((const void *)(x->qs + 64 * c + 32));
            __m512i v0 = _mm512_permutex2var_epi16(ev, first, od), v1 = _mm512_permutex2var_epi16(ev, second, od);
            int64_t at = tile_at(a, s, b, 64 * c);
            _mm256_storeu_si256((__m256i *)(a->hi + at), _mm512_cvtepi16_epi8(_mm512_srai_epi16(v0, 8)));
            _mm256_storeu_si256((__m256i *)(a->hi + at + 32), _mm512_cvtepi16_epi8(_mm512_srai_epi16(v1, 8)));
            _mm256_storeu_si256((__m256i *)(a->lo + at), _mm512_cvtepi16_epi8(_mm512_and_si512(v0, low)));
            _mm256_storeu_si256((__m256i *)(a->lo + at + 32), _mm512_cvtepi16_epi8(_mm512_and_si512(v1, low)));
        }
        memcpy(a->bsums + ((int64_t)s * nb + b) * 8, x->bsums, 8 * sizeof(int32_t));
        a->d[(int64_t)s * nb + b] = x->d;
    }
}
#endif

static void tile_acts_row(const struct block_q16_k *xw, int K, int s, struct tile_acts *a) {
#ifdef TILES_X86
    if (int8_path() == INT8_AVX512_VNNI) {
        vnni_tile_acts_row(xw, K, s, a);
        return;
    }
#endif
    tile_acts_row_ref(xw, K, s, a);
}

/* ---- the scalar reference ---------------------------------------------------------------- */

static void ref_tile_block(int type, const uint8_t *blk, const struct tile_acts *a, int s, int b, int K, float *acc, float *mac) {
    int nb = K / 256;
    const int32_t *bsum = a->bsums + ((int64_t)s * nb + b) * 8;
    int32_t hh = 0, hl = 0, lh = 0, ll = 0, M = 0;
    for (int e = 0; e < 256; e++) {
        int W = ref16_weight(type, blk, e), hi = a->hi[tile_at(a, s, b, e)], lo = a->lo[tile_at(a, s, b, e)];
        int Wh = W >> 8, Wl = W & 255; /* floor: W = 256 Wh + Wl, Wl 0..255 */
        hh += hi * Wh, hl += hi * Wl, lh += lo * Wh, ll += lo * Wl;
    }
    float F = ((float)hh * 65536.0f + (float)hl * 256.0f) + ((float)lh * 256.0f + (float)ll);
    float dx = a->d[(int64_t)s * nb + b];
    *acc = fmaf(F, (type == T_Q6_K ? half_at(blk + 208) : half_at(blk)) * dx, *acc);
    if (type == T_Q6_K) return;
    for (int j = 0; j < 8; j++) {
        int sc, m;
        scale_min_k4(j, blk + 4, &sc, &m);
        M += m * bsum[j];
    }
    *mac = fmaf((float)M, half_at(blk + 2) * dx, *mac);
}

/* ---- the tiles ---------------------------------------------------------------------------- */

static int tiles_state = -1; /* -1: not asked yet */

/* Whether AMX's integer tiles run in this process (asking the kernel for their state once). */
static int tiles_ready(void) {
    if (tiles_state >= 0) return tiles_state;
    int ok = 0;
#ifdef TILES_X86
    ok = int8_runs(INT8_AVX512_VNNI) && amx_has(24) && amx_has(25) && amx_permitted(0); /* AMX-TILE, AMX-INT8 */
#endif
    tiles_state = ok;
    return ok;
}

#ifdef TILES_X86
/* The tiles (amx_configure): 0 and 1 64 inputs' hi and lo of 16 rows; 2 and 3 Wl and Wh of 16
 * outputs (sixteen rows of four inputs each); 4-7 the int32 sums C_hl, C_ll, C_hh, C_lh, 16 rows
 * x 16 outputs. */

/* Byte i of each lane. */
static INLINE TILE_TARGET __m512i byte_of(__m512i v, int i) { return _mm512_and_si512(_mm512_srli_epi32(v, 8 * i), _mm512_set1_epi32(255)); }

/* Four weights of each of 16 outputs (a lane each, unsigned bytes) less `bias` (Q6_K's 32) times
 * their outputs' scales (sc16: the scale in both halves of the lane), split into the products'
 * low bytes (*wl, unsigned) and high bytes (*wh, signed: W = 256 Wh + Wl). */
static INLINE TILE_TARGET void scale_split(__m512i w, __m512i sc16, __m512i bias, __m512i *wl, __m512i *wh) {
    const __m512i even = _mm512_set1_epi32(0x00FF00FF);
    __m512i pe = _mm512_mullo_epi16(_mm512_sub_epi16(_mm512_and_si512(w, even), bias), sc16);                        /* bytes 0, 2 */
    __m512i po = _mm512_mullo_epi16(_mm512_sub_epi16(_mm512_and_si512(_mm512_srli_epi32(w, 8), even), bias), sc16);  /* bytes 1, 3 */
    *wl = _mm512_or_si512(_mm512_and_si512(pe, even), _mm512_slli_epi32(_mm512_and_si512(po, even), 8));
    *wh = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(pe, 8), even), _mm512_andnot_si512(even, po));
}

/* Super-block `base` (of the first output; vidx: each output's offset from it) of 16 outputs as
 * the tiles take it: per 64 inputs q, Wl[q] and Wh[q] with row k4 holding inputs 4 k4 .. 4 k4 + 3
 * of each output; their d (*dv) and, for Q4_K and Q5_K, dmin (*dmv) and the minimums m_j (mn).
 * Every read lies inside the outputs' blocks. */
static INLINE TILE_TARGET void tile_weights(int type, const uint8_t *base, __m512i vidx, uint8_t Wl[4][1024], uint8_t Wh[4][1024],
                                            __m512 *dv, __m512 *dmv, __m512i *mn) {
    const __m512i nib = _mm512_set1_epi32(0x0F0F0F0F), none = _mm512_setzero_si512();
    __m512i l, h;
    if (type == T_Q6_K) {
        /* ql (128), qh (64), 16 signed scales, d at 208 (read as the high half of bytes 206-209) */
        *dv = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_i32gather_epi32(vidx, (const void *)(base + 206), 1), 16)));
        __m512i sc16[16];
        for (int d4 = 0; d4 < 4; d4++) {
            __m512i D = _mm512_i32gather_epi32(vidx, (const void *)(base + 192 + 4 * d4), 1);
            for (int i = 0; i < 4; i++) {
                __m512i v = _mm512_srai_epi32(_mm512_slli_epi32(D, 24 - 8 * i), 24); /* byte i, signed */
                sc16[4 * d4 + i] = _mm512_or_si512(_mm512_and_si512(v, _mm512_set1_epi32(0xFFFF)), _mm512_slli_epi32(v, 16));
            }
        }
        const __m512i bias = _mm512_set1_epi16(32), two = _mm512_set1_epi32(0x03030303);
        for (int q = 0; q < 4; q++) {
            const int half = q / 2, c0 = 2 * (q % 2); /* inputs 64 q + i: h = q / 2, c = c0 + i / 32, l = i % 32 */
            for (int k4 = 0; k4 < 8; k4++) {
                __m512i ql0 = _mm512_i32gather_epi32(vidx, (const void *)(base + 64 * half + 4 * k4), 1);
                __m512i ql1 = _mm512_i32gather_epi32(vidx, (const void *)(base + 64 * half + 32 + 4 * k4), 1);
                __m512i qh = _mm512_i32gather_epi32(vidx, (const void *)(base + 128 + 32 * half + 4 * k4), 1);
                if (c0) ql0 = _mm512_srli_epi32(ql0, 4), ql1 = _mm512_srli_epi32(ql1, 4);
                __m512i w0 = _mm512_or_si512(_mm512_and_si512(ql0, nib), _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(qh, 2 * c0), two), 4));
                __m512i w1 = _mm512_or_si512(_mm512_and_si512(ql1, nib), _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(qh, 2 * c0 + 2), two), 4));
                scale_split(w0, sc16[4 * q + k4 / 4], bias, &l, &h);
                _mm512_store_si512((void *)(Wl[q] + 64 * k4), l);
                _mm512_store_si512((void *)(Wh[q] + 64 * k4), h);
                scale_split(w1, sc16[4 * q + 2 + k4 / 4], bias, &l, &h);
                _mm512_store_si512((void *)(Wl[q] + 64 * (k4 + 8)), l);
                _mm512_store_si512((void *)(Wh[q] + 64 * (k4 + 8)), h);
            }
        }
        return;
    }
    /* Q4_K, Q5_K: d and dmin, then the six-bit sc_j and m_j (scale_min_k4); Q5_K's fifth bits at 16 */
    __m512i w0 = _mm512_i32gather_epi32(vidx, (const void *)base, 1);
    *dv = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(w0));
    *dmv = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(w0, 16)));
    __m512i D0 = _mm512_i32gather_epi32(vidx, (const void *)(base + 4), 1);
    __m512i D1 = _mm512_i32gather_epi32(vidx, (const void *)(base + 8), 1);
    __m512i D2 = _mm512_i32gather_epi32(vidx, (const void *)(base + 12), 1);
    __m512i sc[8];
    const __m512i six = _mm512_set1_epi32(63), four = _mm512_set1_epi32(15), one = _mm512_set1_epi32(0x01010101);
    for (int j = 0; j < 4; j++) {
        sc[j] = _mm512_and_si512(byte_of(D0, j), six);
        mn[j] = _mm512_and_si512(byte_of(D1, j), six);
        sc[j + 4] = _mm512_or_si512(_mm512_and_si512(byte_of(D2, j), four), _mm512_slli_epi32(_mm512_srli_epi32(byte_of(D0, j), 6), 4));
        mn[j + 4] = _mm512_or_si512(_mm512_srli_epi32(byte_of(D2, j), 4), _mm512_slli_epi32(_mm512_srli_epi32(byte_of(D1, j), 6), 4));
    }
    const int qs = type == T_Q5_K ? 48 : 16;
    for (int q = 0; q < 4; q++) {
        /* inputs 64 q + i: sub-block 2q (i < 32, the low nibbles) and 2q + 1 (the high ones) */
        const __m512i sc_lo = _mm512_or_si512(sc[2 * q], _mm512_slli_epi32(sc[2 * q], 16));
        const __m512i sc_hi = _mm512_or_si512(sc[2 * q + 1], _mm512_slli_epi32(sc[2 * q + 1], 16));
        for (int k4 = 0; k4 < 8; k4++) {
            __m512i R = _mm512_i32gather_epi32(vidx, (const void *)(base + qs + 32 * q + 4 * k4), 1);
            __m512i lo = _mm512_and_si512(R, nib), hi = _mm512_and_si512(_mm512_srli_epi32(R, 4), nib);
            if (type == T_Q5_K) {
                __m512i qh = _mm512_i32gather_epi32(vidx, (const void *)(base + 16 + 4 * k4), 1);
                lo = _mm512_or_si512(lo, _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(qh, 2 * q), one), 4));
                hi = _mm512_or_si512(hi, _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(qh, 2 * q + 1), one), 4));
            }
            scale_split(lo, sc_lo, none, &l, &h);
            _mm512_store_si512((void *)(Wl[q] + 64 * k4), l);
            _mm512_store_si512((void *)(Wh[q] + 64 * k4), h);
            scale_split(hi, sc_hi, none, &l, &h);
            _mm512_store_si512((void *)(Wl[q] + 64 * (k4 + 8)), l);
            _mm512_store_si512((void *)(Wh[q] + 64 * (k4 + 8)), h);
        }
    }
}

/* Outputs [r0, r0 + 16) (those below r1 written) of a K-type part against rows [s0, s0 + g) of a. */
static TILE_TARGET void amx_tile_outputs(const struct part *p, int64_t r0, int64_t r1, const struct tile_acts *a, int s0, int g,
                                         int K, float *y, int64_t ldy) {
    const int nb = K / 256, gp = (g + TILE_M - 1) / TILE_M * TILE_M, count = (int)(r1 - r0);
    float acc[TILE_GROUP][16] __attribute__((aligned(64))), mac[TILE_GROUP][16] __attribute__((aligned(64)));
    uint8_t Wl[4][1024] __attribute__((aligned(64))), Wh[4][1024] __attribute__((aligned(64)));
    int32_t C[4][16][16] __attribute__((aligned(64)));
    int32_t off[16];
    for (int n = 0; n < 16; n++) off[n] = (int32_t)((n < count ? n : count - 1) * p->ld);  /* past r1: the last output again */
    const __m512i vidx = _mm512_loadu_si512((const void *)off);
    for (int t = 0; t < gp; t++) {
        _mm512_store_ps(acc[t], _mm512_setzero_ps());
        _mm512_store_ps(mac[t], _mm512_setzero_ps());
    }
    amx_configure();
    for (int b = 0; b < nb; b++) {
        const uint8_t *base = (const uint8_t *)p->data + r0 * p->ld + (int64_t)b * block_bytes(p->type);
        __m512 dv, dmv = _mm512_setzero_ps();
        __m512i mn[8];
        tile_weights(p->type, base, vidx, Wl, Wh, &dv, &dmv, mn);
        for (int t0 = 0; t0 < gp; t0 += TILE_M) {
            _tile_zero(4);
            _tile_zero(5);
            _tile_zero(6);
            _tile_zero(7);
            for (int q = 0; q < 4; q++) {
                const int64_t at = tile_at(a, s0 + t0, b, 64 * q);
                _tile_loadd(0, a->hi + at, 64);
                _tile_loadd(1, a->lo + at, 64);
                _tile_loadd(2, Wl[q], 64);
                _tile_loadd(3, Wh[q], 64);
                _tile_dpbsud(4, 0, 2);
                _tile_dpbuud(5, 1, 2);
                _tile_dpbssd(6, 0, 3); /* Wh signed (Q6_K's below zero) */
                _tile_dpbusd(7, 1, 3);
            }
            _tile_stored(4, C[0], 64);
            _tile_stored(5, C[1], 64);
            _tile_stored(6, C[2], 64);
            _tile_stored(7, C[3], 64);
            const __m512 f256 = _mm512_set1_ps(256.0f), f65536 = _mm512_set1_ps(65536.0f);
            for (int m = 0; m < TILE_M && t0 + m < g; m++) {
                const int s = s0 + t0 + m;
                __m512 hl = _mm512_cvtepi32_ps(_mm512_load_si512((const void *)C[0][m]));
                __m512 ll = _mm512_cvtepi32_ps(_mm512_load_si512((const void *)C[1][m]));
                __m512 hh = _mm512_cvtepi32_ps(_mm512_load_si512((const void *)C[2][m]));
                __m512 lh = _mm512_cvtepi32_ps(_mm512_load_si512((const void *)C[3][m]));
                __m512 F = _mm512_add_ps(_mm512_add_ps(_mm512_mul_ps(hh, f65536), _mm512_mul_ps(hl, f256)),
                                         _mm512_add_ps(_mm512_mul_ps(lh, f256), ll));
                const __m512 dx = _mm512_set1_ps(a->d[(int64_t)s * nb + b]);
                _mm512_store_ps(acc[t0 + m], _mm512_fmadd_ps(F, _mm512_mul_ps(dv, dx), _mm512_load_ps(acc[t0 + m])));
                if (p->type == T_Q6_K) continue;
                const int32_t *bsum = a->bsums + ((int64_t)s * nb + b) * 8;
                __m512i M = _mm512_mullo_epi32(mn[0], _mm512_set1_epi32(bsum[0]));
                for (int j = 1; j < 8; j++) M = _mm512_add_epi32(M, _mm512_mullo_epi32(mn[j], _mm512_set1_epi32(bsum[j])));
                _mm512_store_ps(mac[t0 + m], _mm512_fmadd_ps(_mm512_cvtepi32_ps(M), _mm512_mul_ps(dmv, dx), _mm512_load_ps(mac[t0 + m])));
            }
        }
    }
    _tile_release();
    const __mmask16 keep = (__mmask16)((1u << count) - 1u);
    for (int t = 0; t < g; t++)
        _mm512_mask_storeu_ps(y + (int64_t)t * ldy + r0, keep, _mm512_sub_ps(_mm512_load_ps(acc[t]), _mm512_load_ps(mac[t])));
}
#endif

/* ---- steps and verifications on the tiles: `int8.STEP_TILES` -----------------------------
 *
 * A step's or a verification's products on the tiles must cost about what a step's do on
 * VNNI, and every row count must sum in one order (so a verification's row equals its step).
 * The prefill's order above scales each weight by its sub-block's scale and splits it before
 * the tiles take it: per call, more work than a step's whole product. Here the tiles take the
 * weights as stored (Q4_K's 4-bit w, 0..15; Q5_K's 5-bit, 0..31; Q6_K's 6-bit less 32),
 * gathered for 16 outputs by a transposition of contiguous loads, and the scales apply to each
 * sub-block's sums after (for Q4_K and Q5_K, as written here):
 *   S_j = sum of q_e w_e over sub-block j's 32 inputs   exact: |S_j| <= 32 x 32767 x 31 < 2^25
 *   F   = fmaf((float)S_j, (float)sc_j, F) for j = 0..7, from F = 0
 *   acc = fmaf(F, d_n * d_m, acc)
 *   M   = fmaf((float)m_j, (float)bsum_j, M) for j = 0..7, from M = 0
 *   mac = fmaf(M, dmin_n * d_m, mac)
 * per output n, row m and super-block b in that order (`ref_step_block`, which the tile path
 * follows lane for lane); the output is acc - mac. On the tiles one signed product a sub-block
 * gives every S_j of up to STEP_ROWS rows: the A tile holds each row's hi, its lo less 128 (both
 * signed bytes), and a row of ones, so that S_j = 256 C_hi + C_lo' + 128 C_ones (`step_acts`).
 * Each output of a tile product is formed on its own, so a row does not depend on the rows
 * beside it. Q6_K the same way over its 16 sub-blocks of 16 inputs, with its signed weights less
 * 32 and its signed scales, no minimums (`ref_step_block6`). */

/* Rows a group of the steps' kernel takes: 2 x 7 + 1 tile rows. */
#define STEP_ROWS 7

static inline int step_type(int type) { return type == T_Q4_K || type == T_Q5_K || type == T_Q6_K; }

/* Rows up to which a call takes VNNI (`vnni_step_outputs`) in this order, not the tiles. */
#define VNNI_STEP_ROWS 3

/* The steps' A tiles, a->st[group][K / 64][16][64] (zero where unused), from a's hi and lo of
 * S rows: group G holds rows 7 G .. 7 G + M - 1 as tile rows 0..M-1 their hi, M..2M-1 their lo
 * less 128, 2M ones. */
static int step_acts(struct tile_acts *a, int S, int K) {
    const int groups = (S + STEP_ROWS - 1) / STEP_ROWS, chunks = K / 64;
    a->st = calloc((size_t)groups * chunks * 16 * 64, 1);
    a->fb = malloc(sizeof(float) * (size_t)S * (size_t)(K / 256) * 8);
    if (!a->st || !a->fb) return -1;
    for (int64_t i = 0; i < (int64_t)S * (K / 256) * 8; i++) a->fb[i] = (float)a->bsums[i];
    for (int G = 0; G < groups; G++) {
        const int M = S - STEP_ROWS * G < STEP_ROWS ? S - STEP_ROWS * G : STEP_ROWS;
        for (int c = 0; c < chunks; c++) {
            uint8_t *t = a->st + ((int64_t)G * chunks + c) * 16 * 64;
            for (int m = 0; m < M; m++) {
                const int64_t at = ((int64_t)c * a->S_pad + STEP_ROWS * G + m) * 64;
                memcpy(t + 64 * m, a->hi + at, 64);
                for (int e = 0; e < 64; e++) t[64 * (M + m) + e] = (uint8_t)(a->lo[at + e] ^ 0x80);
            }
            memset(t + 64 * 2 * M, 1, 64);
        }
    }
    return 0;
}

/* Weight e (0..255) of a Q4_K or Q5_K super-block as stored (no scale, no minimum). */
static inline int ref_step_weight(int type, const uint8_t *blk, int e) {
    int q = e / 64, i = e % 64, l = i % 32;
    const uint8_t *qs = blk + (type == T_Q5_K ? 48 : 16) + 32 * q;
    int w = i < 32 ? (qs[l] & 15) : (qs[l] >> 4);
    if (type == T_Q5_K) w |= (blk[16 + l] >> (2 * q + i / 32) & 1) << 4;
    return w;
}

/* Weight e (0..255) of a Q6_K super-block less its 32: -32..31. */
static inline int ref_step_weight6(const uint8_t *blk, int e) {
    int h = e / 128, i = e % 128, g = i / 32, l = i % 32;
    int ql = blk[64 * h + 32 * (g % 2) + l], qh = blk[128 + 32 * h + l];
    return ((g < 2 ? ql & 15 : ql >> 4) | (qh >> (2 * g) & 3) << 4) - 32;
}

/* Q6_K in the same order: 16 sub-blocks of 16 inputs, its int8 scales, no minimums. */
static void ref_step_block6(const uint8_t *blk, const struct tile_acts *a, int s, int b, int K, float *acc) {
    float F = 0.0f;
    for (int j = 0; j < 16; j++) {
        int32_t S = 0;
        for (int e = 16 * j; e < 16 * j + 16; e++)
            S += (256 * a->hi[tile_at(a, s, b, e)] + a->lo[tile_at(a, s, b, e)]) * ref_step_weight6(blk, e);
        F = fmaf((float)S, (float)(int8_t)blk[192 + j], F);
    }
    *acc = fmaf(F, half_at(blk + 208) * a->d[(int64_t)s * (K / 256) + b], *acc);
}

static void ref_step_block(int type, const uint8_t *blk, const struct tile_acts *a, int s, int b, int K, float *acc, float *mac) {
    if (type == T_Q6_K) {
        ref_step_block6(blk, a, s, b, K, acc);
        return;
    }
    int nb = K / 256;
    const int32_t *bsum = a->bsums + ((int64_t)s * nb + b) * 8;
    float F = 0.0f, M = 0.0f;
    for (int j = 0; j < 8; j++) {
        int32_t S = 0;
        for (int e = 32 * j; e < 32 * j + 32; e++)
            S += (256 * a->hi[tile_at(a, s, b, e)] + a->lo[tile_at(a, s, b, e)]) * ref_step_weight(type, blk, e);
        int sc, m;
        scale_min_k4(j, blk + 4, &sc, &m);
        F = fmaf((float)S, (float)sc, F);
    }
    float dx = a->d[(int64_t)s * nb + b];
    *acc = fmaf(F, half_at(blk) * dx, *acc);
    for (int j = 0; j < 8; j++) {
        int sc, m;
        scale_min_k4(j, blk + 4, &sc, &m);
        M = fmaf((float)m, (float)bsum[j], M);
    }
    *mac = fmaf(M, half_at(blk + 2) * dx, *mac);
}

/* The scalar reference of either order (a->steps: the steps', else a prefill's `ref_tile_block`). */
static void ref_tile_outputs(const struct part *p, int64_t r0, int64_t r1, const struct tile_acts *a, int s0, int g, int K,
                             float *y, int64_t ldy) {
    int bb = block_bytes(p->type);
    void (*block)(int, const uint8_t *, const struct tile_acts *, int, int, int, float *, float *) =
        a->steps ? ref_step_block : ref_tile_block;
    for (int64_t r = r0; r < r1; r++)
        for (int s = s0; s < s0 + g; s++) {
            float acc = 0.0f, mac = 0.0f;
            for (int b = 0; b < K / 256; b++) block(p->type, (const uint8_t *)p->data + r * p->ld + (int64_t)b * bb, a, s, b, K, &acc, &mac);
            y[(int64_t)(s - s0) * ldy + r] = acc - mac;
        }
}

#ifdef TILES_X86
/* The steps' tiles for M rows and sub-blocks of `sub` inputs (32; Q6_K's 16): 0 and 1 two
 * sub-blocks' A tiles (2M + 1 rows of `sub` bytes), 2 and 3 their weights for 16 outputs
 * (sub / 4 rows of four inputs each), 4-7 the int32 sums (2M + 1 rows x 16 outputs), two
 * sub-blocks' in one pair, the next two's in the other. */
static TILE_TARGET void step_tiles_configure(int M, int sub) {
    struct amx_config c;
    memset(&c, 0, sizeof(c));
    c.palette = 1;
    c.rows[0] = c.rows[1] = (uint8_t)(2 * M + 1), c.colsb[0] = c.colsb[1] = (uint16_t)sub;  /* a sub-block's bytes */
    c.rows[2] = c.rows[3] = (uint8_t)(sub / 4), c.colsb[2] = c.colsb[3] = 64;
    for (int t = 4; t < 8; t++) c.rows[t] = (uint8_t)(2 * M + 1), c.colsb[t] = 64;
    _tile_loadconfig(&c);
}

/* Outputs 16 + n0 .. 16 + n0 + count - 1's super-block (base + 16 rows on: the next job's, read
 * a job from now) asked for into the second-level cache, every line it touches. Each kernel
 * asks for the next job's 16 a few at a time, spread over a super-block's work: 48 requests in
 * a burst at its start (as before) stalled on the queue of misses, and the stalls were a fifth
 * of the tiles' samples in `perf` (on the instructions after the requests). Over 19 16384 x 2048
 * matrices read from memory (the A/B loop of `bench.int8_rows --matrices 19`, alternated):
 * spread and into the second level against a burst into the first, Q4_K 0.95x at 1 row (VNNI),
 * 0.83-0.85x at 7 (the tiles), Q6_K 0.80x at 1 and 0.82-0.83x at 7; a burst into the second
 * level alone 0.96x at 7 rows, spread into the first 0.89x, two jobs ahead as one; in the 1B
 * shape's forwards at 8K (`bench.kernel_ab --base` the burst) a step 1.06-1.11x faster, a 7-row
 * verification 1.10-1.12x. The second level is the trade of a forward, whose weights come from
 * memory: a matrix that stays in the third level runs a step's Q4_K faster with the lines asked
 * into the first (0.81x), Q6_K not (1.04x), and from memory the first level loses 3-9 %. Before
 * it, a burst against none: 1.13 against 1.75 ms (one row). */
static INLINE void step_ahead(const struct part *p, int64_t r0, const uint8_t *base, int bb, int n0, int count) {
    for (int n = 16 + n0; n < 16 + n0 + count && r0 + n < p->rows; n++) {
        const uint8_t *at = base + n * p->ld;
        const uint8_t *line = (const uint8_t *)((uintptr_t)at & ~(uintptr_t)63);
        for (; line < at + bb; line += 64) __builtin_prefetch(line, 0, 2);
    }
}

/* Q4_K's and Q5_K's 16 outputs' d, dmin, sc_j and m_j (scale_min_k4) as floats, gathered. */
static INLINE TILE_TARGET void step_scales4(const uint8_t *base, __m512i vidx, __m512 sc[8], __m512 mn[8], __m512 *dv, __m512 *dmv) {
    const __m512i six = _mm512_set1_epi32(63), four = _mm512_set1_epi32(15);
    __m512i w0 = _mm512_i32gather_epi32(vidx, (const void *)base, 1);
    *dv = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(w0));
    *dmv = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(w0, 16)));
    __m512i D0 = _mm512_i32gather_epi32(vidx, (const void *)(base + 4), 1);
    __m512i D1 = _mm512_i32gather_epi32(vidx, (const void *)(base + 8), 1);
    __m512i D2 = _mm512_i32gather_epi32(vidx, (const void *)(base + 12), 1);
    for (int j = 0; j < 4; j++) {
        sc[j] = _mm512_cvtepi32_ps(_mm512_and_si512(byte_of(D0, j), six));
        mn[j] = _mm512_cvtepi32_ps(_mm512_and_si512(byte_of(D1, j), six));
        sc[j + 4] = _mm512_cvtepi32_ps(_mm512_or_si512(_mm512_and_si512(byte_of(D2, j), four),
                                                       _mm512_slli_epi32(_mm512_srli_epi32(byte_of(D0, j), 6), 4)));
        mn[j + 4] = _mm512_cvtepi32_ps(_mm512_or_si512(_mm512_srli_epi32(byte_of(D2, j), 4),
                                                       _mm512_slli_epi32(_mm512_srli_epi32(byte_of(D1, j), 6), 4)));
    }
}

/* A super-block's F for M rows from its `subs` sub-blocks' tile sums C[j][tile row][output]
 * (rows 0..M-1 hi, M..2M-1 lo less 128, 2M the weights' sums): S_j = 256 C_hi + C_lo' + 128
 * C_ones, F = fmaf(S_j, sc_j, F) in j's order. */
static INLINE TILE_TARGET void step_sums(const int32_t (*C)[16][16], int subs, int M, const __m512 *sc, __m512 *F) {
    for (int m = 0; m < M; m++) F[m] = _mm512_setzero_ps();
    for (int j = 0; j < subs; j++) {
        const __m512i w128 = _mm512_slli_epi32(_mm512_load_si512((const void *)C[j][2 * M]), 7);
        for (int m = 0; m < M; m++) {
            __m512i S = _mm512_add_epi32(_mm512_add_epi32(_mm512_slli_epi32(_mm512_load_si512((const void *)C[j][m]), 8),
                                                          _mm512_load_si512((const void *)C[j][M + m])), w128);
            F[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(S), sc[j], F[m]);
        }
    }
}

/* The 32 bytes at base + off[n] of 16 outputs as 8 rows of 16 dwords: row k the dword k of
 * every output. Outputs n and n + 8 share a register, then an 8 x 8 transposition of dwords in
 * each half. */
static INLINE TILE_TARGET void step_transpose(const uint8_t *base, const int64_t *off, __m512i rows[8]) {
    __m512i z[8], t[8];
    for (int n = 0; n < 8; n++)
        z[n] = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(base + off[n]))),
                                  _mm256_loadu_si256((const __m256i *)(base + off[n + 8])), 1);
    for (int i = 0; i < 4; i++) {
        t[2 * i] = _mm512_unpacklo_epi32(z[2 * i], z[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_epi32(z[2 * i], z[2 * i + 1]);
    }
    for (int i = 0; i < 2; i++) {
        z[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
        z[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
        z[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
        z[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
    }
    /* z[0..3]: outputs 0-3 (and 8-11), z[4..7]: 4-7 (12-15); in each 128-bit lane of z[i] the
       dwords k = i (lanes 0, 2) and k = i + 4 (lanes 1, 3) of four outputs */
    const __m512i first = _mm512_setr_epi64(0, 1, 8, 9, 4, 5, 12, 13), second = _mm512_setr_epi64(2, 3, 10, 11, 6, 7, 14, 15);
    for (int i = 0; i < 4; i++) {
        rows[i] = _mm512_permutex2var_epi64(z[i], first, z[i + 4]);
        rows[i + 4] = _mm512_permutex2var_epi64(z[i], second, z[i + 4]);
    }
}

/* Q4_K's or Q5_K's weights of 64 inputs 64c + 4k + t (lo: sub-block 2c) and 64c + 32 + 4k + t
 * (hi: 2c + 1) of 16 outputs from row k of their transposed nibbles, with Q5_K's fifth bits from
 * row k of its transposed qh. */
static INLINE TILE_TARGET void step_weights4(__m512i nibbles, __m512i qh, int q5, int c, __m512i *lo, __m512i *hi) {
    const __m512i nib = _mm512_set1_epi8(15), one = _mm512_set1_epi8(1);
    *lo = _mm512_and_si512(nibbles, nib);
    *hi = _mm512_and_si512(_mm512_srli_epi16(nibbles, 4), nib);
    if (q5) {
        *lo = _mm512_or_si512(*lo, _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(qh, 2 * c), one), 4));
        *hi = _mm512_or_si512(*hi, _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(qh, 2 * c + 1), one), 4));
    }
}

/* A step's rows (up to VNNI_STEP_ROWS) on VNNI in the same order, 16 outputs in the lanes: the
 * weights transposed as for the tiles (a dword of four inputs of each output), split into
 * 16-bit pairs of even and of odd inputs, against the row's pair of the same inputs broadcast
 * (block_q16_k keeps a 64's evens, then its odds: two consecutive activations are such a pair).
 * One vpdpwssd then adds a pair to every output's S_j, which comes out in its lane, no
 * reduction across lanes; the float operations after are the tiles' own, lane for lane. The
 * tiles' fixed costs (the weights and the sums through memory) do not pay for so few rows: over
 * 16384 x 2048 Q4_K matrices read from memory, 1, 2 and 3 rows here took 1.09, 1.00 and 0.78x
 * WIDE's time, the tiles 1.25x at 2 rows (`python -m bench.int8_rows --matrices 19`; Q6_K on
 * the tiles at 2 and 3 rows 1.28x and 1.30x, here 1.07x and 1.15x). Outputs [r0, r0 + 16), those
 * below r1 written; x the rows' K / 256 blocks each, y their outputs ldy apart. */
static INLINE TILE_TARGET void vnni_step_rows(const struct part *p, int64_t r0, int64_t r1, const struct block_q16_k *x, int K,
                                             float *y, int64_t ldy, const int R) {
    const int nb = K / 256, count = (int)(r1 - r0), bb = block_bytes(p->type), q5 = p->type == T_Q5_K, qs0 = q5 ? 48 : 16;
    int32_t off32[16];
    int64_t off[16];
    for (int n = 0; n < 16; n++) off[n] = (n < count ? n : count - 1) * p->ld, off32[n] = (int32_t)off[n];
    const __m512i vidx = _mm512_loadu_si512((const void *)off32);
    const __m512i even = _mm512_set1_epi16(255);
    __m512 acc[VNNI_STEP_ROWS], mac[VNNI_STEP_ROWS];
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps(), mac[r] = _mm512_setzero_ps();
    for (int b = 0; b < nb; b++) {
        const uint8_t *base = (const uint8_t *)p->data + r0 * p->ld + (int64_t)b * bb;
        __m512i qh[8];
        if (q5) step_transpose(base + 16, off, qh);
        __m512i S[VNNI_STEP_ROWS][8];
        for (int r = 0; r < R; r++)
            for (int j = 0; j < 8; j++) S[r][j] = _mm512_setzero_si512();
        for (int c = 0; c < 4; c++) {
            __m512i rows[8];
            step_ahead(p, r0, base, bb, 4 * c, 4);
            step_transpose(base + qs0 + 32 * c, off, rows);
            for (int k = 0; k < 8; k++) {
                /* inputs 64c + 4k + t (sub-block 2c) and 64c + 32 + 4k + t (2c + 1) of each output */
                __m512i lo, hi;
                step_weights4(rows[k], q5 ? qh[k] : rows[k], q5, c, &lo, &hi);
                /* inputs t = 0, 2 and t = 1, 3 as 16-bit pairs, against the activations' pairs: an
                   even input 64c + i at qs[64c + i / 2], an odd one at qs[64c + 32 + i / 2] */
                const __m512i le = _mm512_and_si512(lo, even), lo8 = _mm512_srli_epi16(lo, 8);
                const __m512i he = _mm512_and_si512(hi, even), ho8 = _mm512_srli_epi16(hi, 8);
                for (int r = 0; r < R; r++) {
                    const int32_t *xq = (const int32_t *)x[(int64_t)r * nb + b].qs;
                    S[r][2 * c] = _mm512_dpwssd_epi32(S[r][2 * c], le, _mm512_set1_epi32(xq[32 * c + k]));
                    S[r][2 * c] = _mm512_dpwssd_epi32(S[r][2 * c], lo8, _mm512_set1_epi32(xq[32 * c + 16 + k]));
                    S[r][2 * c + 1] = _mm512_dpwssd_epi32(S[r][2 * c + 1], he, _mm512_set1_epi32(xq[32 * c + 8 + k]));
                    S[r][2 * c + 1] = _mm512_dpwssd_epi32(S[r][2 * c + 1], ho8, _mm512_set1_epi32(xq[32 * c + 24 + k]));
                }
            }
        }
        __m512 sc[8], mn[8], dv, dmv;
        step_scales4(base, vidx, sc, mn, &dv, &dmv);
        for (int r = 0; r < R; r++) {
            const struct block_q16_k *xb = x + (int64_t)r * nb + b;
            __m512 F = _mm512_setzero_ps(), Mm = _mm512_setzero_ps();
            for (int j = 0; j < 8; j++) F = _mm512_fmadd_ps(_mm512_cvtepi32_ps(S[r][j]), sc[j], F);
            const __m512 dx = _mm512_set1_ps(xb->d);
            acc[r] = _mm512_fmadd_ps(F, _mm512_mul_ps(dv, dx), acc[r]);
            for (int j = 0; j < 8; j++) Mm = _mm512_fmadd_ps(mn[j], _mm512_set1_ps((float)xb->bsums[j]), Mm);
            mac[r] = _mm512_fmadd_ps(Mm, _mm512_mul_ps(dmv, dx), mac[r]);
        }
    }
    for (int r = 0; r < R; r++)
        _mm512_mask_storeu_ps(y + (int64_t)r * ldy + r0, (__mmask16)((1u << count) - 1u), _mm512_sub_ps(acc[r], mac[r]));
}

/* Q6_K's 16 outputs' scales (16 signed bytes each, as floats) and d, gathered. */
static INLINE TILE_TARGET void step_scales6(const uint8_t *base, __m512i vidx, __m512 sc[16], __m512 *dv) {
    *dv = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_i32gather_epi32(vidx, (const void *)(base + 206), 1), 16)));
    for (int d4 = 0; d4 < 4; d4++) {
        __m512i D = _mm512_i32gather_epi32(vidx, (const void *)(base + 192 + 4 * d4), 1);
        for (int i = 0; i < 4; i++) sc[4 * d4 + i] = _mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(D, 24 - 8 * i), 24));
    }
}

/* Q6_K's weights less 32 (signed bytes) of 32 inputs 128 h + 32 g + 4 k + t of 16 outputs, row k
 * the dword k of every output, from the transposed ql (the first and the second 32 of the half)
 * and qh. */
static INLINE TILE_TARGET __m512i step_weights6(const __m512i *t1, const __m512i *t2, const __m512i *th, int g, int k) {
    const __m512i nib = _mm512_set1_epi8(15), three = _mm512_set1_epi8(3);
    __m512i l = g % 2 ? t2[k] : t1[k];
    l = g < 2 ? _mm512_and_si512(l, nib) : _mm512_and_si512(_mm512_srli_epi16(l, 4), nib);
    __m512i h = _mm512_and_si512(_mm512_srli_epi16(th[k], 2 * g), three);
    return _mm512_sub_epi8(_mm512_or_si512(l, _mm512_slli_epi16(h, 4)), _mm512_set1_epi8(32));
}

/* vnni_step_rows for Q6_K: 16 sub-blocks of 16 inputs, each finished (its float product added in
 * order) as soon as its 32-input group is. */
static INLINE TILE_TARGET void vnni_step_rows6(const struct part *p, int64_t r0, int64_t r1, const struct block_q16_k *x, int K,
                                              float *y, int64_t ldy, const int R) {
    const int nb = K / 256, count = (int)(r1 - r0), bb = block_bytes(p->type);
    int32_t off32[16];
    int64_t off[16];
    for (int n = 0; n < 16; n++) off[n] = (n < count ? n : count - 1) * p->ld, off32[n] = (int32_t)off[n];
    const __m512i vidx = _mm512_loadu_si512((const void *)off32);
    __m512 acc[VNNI_STEP_ROWS];
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    for (int b = 0; b < nb; b++) {
        const uint8_t *base = (const uint8_t *)p->data + r0 * p->ld + (int64_t)b * bb;
        __m512 sc[16], dv, F[VNNI_STEP_ROWS];
        step_scales6(base, vidx, sc, &dv);
        for (int r = 0; r < R; r++) F[r] = _mm512_setzero_ps();
        for (int h = 0; h < 2; h++) {
            __m512i t1[8], t2[8], th[8];
            step_transpose(base + 64 * h, off, t1);
            step_transpose(base + 64 * h + 32, off, t2);
            step_transpose(base + 128 + 32 * h, off, th);
            for (int g = 0; g < 4; g++) {
                const int c = 2 * h + g / 2, o = 8 * (g % 2); /* the activations' 64 and pair offset */
                step_ahead(p, r0, base, bb, 8 * h + 2 * g, 2);
                __m512i S[VNNI_STEP_ROWS][2];
                for (int r = 0; r < R; r++) S[r][0] = S[r][1] = _mm512_setzero_si512();
                for (int k = 0; k < 8; k++) {
                    const __m512i w = step_weights6(t1, t2, th, g, k);
                    const __m512i ev = _mm512_srai_epi16(_mm512_slli_epi16(w, 8), 8), od = _mm512_srai_epi16(w, 8);
                    for (int r = 0; r < R; r++) {
                        const int32_t *xq = (const int32_t *)x[(int64_t)r * nb + b].qs;
                        S[r][k / 4] = _mm512_dpwssd_epi32(S[r][k / 4], ev, _mm512_set1_epi32(xq[32 * c + o + k]));
                        S[r][k / 4] = _mm512_dpwssd_epi32(S[r][k / 4], od, _mm512_set1_epi32(xq[32 * c + 16 + o + k]));
                    }
                }
                for (int r = 0; r < R; r++) {
                    F[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(S[r][0]), sc[8 * h + 2 * g], F[r]);
                    F[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(S[r][1]), sc[8 * h + 2 * g + 1], F[r]);
                }
            }
        }
        for (int r = 0; r < R; r++)
            acc[r] = _mm512_fmadd_ps(F[r], _mm512_mul_ps(dv, _mm512_set1_ps(x[(int64_t)r * nb + b].d)), acc[r]);
    }
    for (int r = 0; r < R; r++) _mm512_mask_storeu_ps(y + (int64_t)r * ldy + r0, (__mmask16)((1u << count) - 1u), acc[r]);
}

/* vnni_step_rows compiled for each row count (its sums stay in registers). */
static TILE_TARGET void vnni_step_outputs(const struct part *p, int64_t r0, int64_t r1, const struct block_q16_k *x, int K,
                                          float *y, int64_t ldy, int R) {
    if (p->type == T_Q6_K) {
        switch (R) {
        case 1: vnni_step_rows6(p, r0, r1, x, K, y, ldy, 1); break;
        case 2: vnni_step_rows6(p, r0, r1, x, K, y, ldy, 2); break;
        default: vnni_step_rows6(p, r0, r1, x, K, y, ldy, 3); break;
        }
        return;
    }
    switch (R) {
    case 1: vnni_step_rows(p, r0, r1, x, K, y, ldy, 1); break;
    case 2: vnni_step_rows(p, r0, r1, x, K, y, ldy, 2); break;
    default: vnni_step_rows(p, r0, r1, x, K, y, ldy, 3); break;
    }
}

/* amx_step_outputs for Q6_K: a tile product a sub-block of 16 inputs (A tiles of 16 bytes a
 * row, B tiles of 4 rows: four inputs of 16 outputs each), its weights less 32 signed, no
 * minimums; the super-blocks pipelined as there. */
static TILE_TARGET void amx_step_outputs6(const struct part *p, int64_t r0, int64_t r1, const struct tile_acts *a, int s0, int g,
                                          int K, float *y, int64_t ldy) {
    const int nb = K / 256, count = (int)(r1 - r0), bb = block_bytes(p->type);
    int32_t C[2][16][16][16] __attribute__((aligned(64))); /* [super-block parity][sub-block][tile row][output] */
    uint8_t B[16][256] __attribute__((aligned(64)));       /* [sub-block][4 rows of 16 outputs' 4 inputs] */
    int32_t off32[16];
    int64_t off[16];
    for (int n = 0; n < 16; n++) off[n] = (n < count ? n : count - 1) * p->ld, off32[n] = (int32_t)off[n];
    const __m512i vidx = _mm512_loadu_si512((const void *)off32);
    for (int t0 = 0; t0 < g; t0 += STEP_ROWS) {
        const int M = g - t0 < STEP_ROWS ? g - t0 : STEP_ROWS;
        const uint8_t *st = a->st + (int64_t)((s0 + t0) / STEP_ROWS) * (K / 64) * 16 * 64;
        __m512 acc[STEP_ROWS];
        for (int m = 0; m < M; m++) acc[m] = _mm512_setzero_ps();
        step_tiles_configure(M, 16);
        __m512 sc[2][16], dv[2];
        for (int b = 0; b <= nb; b++) {
            const int cur = b & 1, prev = cur ^ 1;
            if (b < nb) {
                const uint8_t *base = (const uint8_t *)p->data + r0 * p->ld + (int64_t)b * bb;
                step_scales6(base, vidx, sc[cur], &dv[cur]);
                for (int h = 0; h < 2; h++) {
                    __m512i t1[8], t2[8], th[8];
                    step_transpose(base + 64 * h, off, t1);
                    step_transpose(base + 64 * h + 32, off, t2);
                    step_transpose(base + 128 + 32 * h, off, th);
                    for (int q = 0; q < 4; q++)  /* sub-blocks 8h + 2q (rows 0-3) and 8h + 2q + 1 (4-7) */
                        for (int k = 0; k < 8; k++)
                            _mm512_store_si512((void *)(B[8 * h + 2 * q] + 64 * k), step_weights6(t1, t2, th, q, k));
                }
                for (int j = 0; j < 16; j += 2) {
                    if (t0 == 0) step_ahead(p, r0, base, bb, j, 2);
                    const uint8_t *at = st + (int64_t)(4 * b + j / 4) * 16 * 64 + 16 * (j % 4);
                    _tile_loadd(0, at, 64);
                    _tile_loadd(1, at + 16, 64);
                    _tile_loadd(2, B[j], 64);
                    _tile_loadd(3, B[j + 1], 64);
                    if (j % 4 == 0) {
                        _tile_zero(4);
                        _tile_zero(5);
                        _tile_dpbssd(4, 0, 2);
                        _tile_dpbssd(5, 1, 3);
                        _tile_stored(4, C[cur][j], 64);
                        _tile_stored(5, C[cur][j + 1], 64);
                    } else {
                        _tile_zero(6);
                        _tile_zero(7);
                        _tile_dpbssd(6, 0, 2);
                        _tile_dpbssd(7, 1, 3);
                        _tile_stored(6, C[cur][j], 64);
                        _tile_stored(7, C[cur][j + 1], 64);
                    }
                }
            }
            if (b == 0) continue;
            const int pb = b - 1;
            __m512 F[STEP_ROWS];
            step_sums(C[prev], 16, M, sc[prev], F);
            for (int m = 0; m < M; m++)
                acc[m] = _mm512_fmadd_ps(F[m], _mm512_mul_ps(dv[prev], _mm512_set1_ps(a->d[(int64_t)(s0 + t0 + m) * nb + pb])), acc[m]);
        }
        const __mmask16 keep = (__mmask16)((1u << count) - 1u);
        for (int m = 0; m < M; m++) _mm512_mask_storeu_ps(y + (int64_t)(t0 + m) * ldy + r0, keep, acc[m]);
    }
    _tile_release();
}

/* Outputs [r0, r0 + 16) (those below r1 written) of a Q4_K or Q5_K part against rows [s0, s0 + g)
 * of a (s0 a multiple of STEP_ROWS). */
static TILE_TARGET void amx_step_outputs(const struct part *p, int64_t r0, int64_t r1, const struct tile_acts *a, int s0, int g,
                                         int K, float *y, int64_t ldy) {
    if (p->type == T_Q6_K) {
        amx_step_outputs6(p, r0, r1, a, s0, g, K, y, ldy);
        return;
    }
    const int nb = K / 256, count = (int)(r1 - r0), q5 = p->type == T_Q5_K, qs0 = q5 ? 48 : 16, bb = block_bytes(p->type);
    int32_t C[2][8][16][16] __attribute__((aligned(64))); /* [super-block parity][sub-block][tile row][output] */
    uint8_t B[8][512] __attribute__((aligned(64)));     /* [2 q + (high nibbles)] */
    int32_t off32[16];
    int64_t off[16];
    for (int n = 0; n < 16; n++) off[n] = (n < count ? n : count - 1) * p->ld, off32[n] = (int32_t)off[n];  /* past r1: the last output again */
    const __m512i vidx = _mm512_loadu_si512((const void *)off32);
    for (int t0 = 0; t0 < g; t0 += STEP_ROWS) {
        const int M = g - t0 < STEP_ROWS ? g - t0 : STEP_ROWS;
        const uint8_t *st = a->st + (int64_t)((s0 + t0) / STEP_ROWS) * (K / 64) * 16 * 64;
        __m512 acc[STEP_ROWS], mac[STEP_ROWS];
        for (int m = 0; m < M; m++) acc[m] = _mm512_setzero_ps(), mac[m] = _mm512_setzero_ps();
        step_tiles_configure(M, 32);
        /* software-pipelined: super-block b's tile products are issued before super-block
           b - 1's sums are read back (C and the scales two deep), so neither the tile stores
           nor the tile products are waited for */
        __m512 sc[2][8], mn[2][8], dv[2], dmv[2];
        for (int b = 0; b <= nb; b++) {
            const int cur = b & 1, prev = cur ^ 1;
            if (b < nb) {
                const uint8_t *base = (const uint8_t *)p->data + r0 * p->ld + (int64_t)b * bb;
                step_scales4(base, vidx, sc[cur], mn[cur], &dv[cur], &dmv[cur]);
                __m512i qh[8];
                if (q5) step_transpose(base + 16, off, qh);
                /* every weight of the super-block first, then the tile products: a tile load
                   right after the stores it reads waited for them */
                for (int q = 0; q < 4; q++) {
                    __m512i rows[8];
                    step_transpose(base + qs0 + 32 * q, off, rows);
                    for (int k = 0; k < 8; k++) {
                        __m512i lo, hi;
                        step_weights4(rows[k], q5 ? qh[k] : rows[k], q5, q, &lo, &hi);
                        _mm512_store_si512((void *)(B[2 * q] + 64 * k), lo);
                        _mm512_store_si512((void *)(B[2 * q + 1] + 64 * k), hi);
                    }
                }
                for (int q = 0; q < 4; q++) {
                    if (t0 == 0) step_ahead(p, r0, base, bb, 4 * q, 4);
                    const uint8_t *at = st + (int64_t)(4 * b + q) * 16 * 64;
                    _tile_loadd(2, B[2 * q], 64);
                    _tile_loadd(3, B[2 * q + 1], 64);
                    _tile_loadd(0, at, 64);
                    _tile_loadd(1, at + 32, 64);
                    if (q % 2 == 0) {
                        _tile_zero(4);
                        _tile_zero(5);
                        _tile_dpbsud(4, 0, 2);
                        _tile_dpbsud(5, 1, 3);
                        _tile_stored(4, C[cur][2 * q], 64);
                        _tile_stored(5, C[cur][2 * q + 1], 64);
                    } else {
                        _tile_zero(6);
                        _tile_zero(7);
                        _tile_dpbsud(6, 0, 2);
                        _tile_dpbsud(7, 1, 3);
                        _tile_stored(6, C[cur][2 * q], 64);
                        _tile_stored(7, C[cur][2 * q + 1], 64);
                    }
                }
            }
            if (b == 0) continue;
            /* super-block b - 1's sums */
            const int pb = b - 1;
            __m512 F[STEP_ROWS];
            step_sums(C[prev], 8, M, sc[prev], F);
            for (int m = 0; m < M; m++) {
                const int s = s0 + t0 + m;
                const __m512 dx = _mm512_set1_ps(a->d[(int64_t)s * nb + pb]);
                acc[m] = _mm512_fmadd_ps(F[m], _mm512_mul_ps(dv[prev], dx), acc[m]);
                const float *bsum = a->fb + ((int64_t)s * nb + pb) * 8;
                __m512 Mm = _mm512_setzero_ps();
                for (int j = 0; j < 8; j++) Mm = _mm512_fmadd_ps(mn[prev][j], _mm512_set1_ps(bsum[j]), Mm);
                mac[m] = _mm512_fmadd_ps(Mm, _mm512_mul_ps(dmv[prev], dx), mac[m]);
            }
        }
        const __mmask16 keep = (__mmask16)((1u << count) - 1u);
        for (int m = 0; m < M; m++)
            _mm512_mask_storeu_ps(y + (int64_t)(t0 + m) * ldy + r0, keep, _mm512_sub_ps(acc[m], mac[m]));
    }
    _tile_release();
}
#endif

/* Outputs [r0, r1) (at most 16) of a K-type part against rows [s0, s0 + g) of a, g <= TILE_GROUP:
 * y[(s - s0) * ldy + r]. The tiles where they run and the path is the widest, else the reference. */
static void tile_outputs(const struct part *p, int64_t r0, int64_t r1, const struct tile_acts *a, int s0, int g, int K, float *y,
                         int64_t ldy, int path) {
#ifdef TILES_X86
    if (path == INT8_AVX512_VNNI && tiles_ready()) {
        if (a->steps)
            amx_step_outputs(p, r0, r1, a, s0, g, K, y, ldy);
        else
            amx_tile_outputs(p, r0, r1, a, s0, g, K, y, ldy);
        return;
    }
#endif
    (void)path;
    ref_tile_outputs(p, r0, r1, a, s0, g, K, y, ldy);
}

/* Whether this process runs the tiles (for int8.py: the prefill takes TILES only then). */
int int8_tiles(void) { return tiles_ready() && int8_path() == INT8_AVX512_VNNI; }
