/* A prefill's products of the 256-weight types (Q4_K, Q5_K, Q6_K) on AMX tiles: `int8.TILES`.
 *
 * Why a prefill only: a prefill multiplies every weight by hundreds of rows, where AMX's tile
 * products (a 16 x 16 block of int32 sums over 64 bytes in one instruction) leave the vector
 * units only the bookkeeping. A step or a verification keeps q_k_int16.c's order: their rows
 * must equal each other bit for bit, and the tiles' sums do not come out in that order's lanes.
 * A prefill's rows only have to be the same whatever rows come with them, which these are
 * (each row quantized on its own, every output in one order).
 *
 * The activations are q_k_int16.c's (struct block_q16_k, the same quantization), each q split
 * exactly into q = 256 hi + lo, hi signed (-128..127), lo unsigned (0..255). A weight times its
 * sub-block's integer scale, W (q_k_int16.c's: Q4_K sc w, 0..945; Q5_K 0..1,953; Q6_K
 * sc (w - 32), -3,968..4,096), is split the same way: W = 256 Wh + Wl, Wh signed (-16..16), Wl
 * 0..255. With the scale inside the weights, a super-block's 256 products sum in one tile
 * accumulator each, no store per sub-block:
 *   C_hh = sum of hi Wh, C_hl = sum of hi Wl, C_lh = sum of lo Wh, C_ll = sum of lo Wl
 *          (over the super-block's 256 inputs; exact, each below 2^24 in magnitude: C_ll <= 256 * 255 * 255)
 *   F    = ((float)C_hh * 65536 + (float)C_hl * 256) + ((float)C_lh * 256 + (float)C_ll)
 *          (the conversions and the products by powers of two exact; three roundings, in this order)
 *   acc  = fmaf(F, d_n * d_m, acc)
 *   M    = sum of m_j bsum_j over the sub-blocks j    exact: < 8 * 63 * 32 * 32767 < 2^31
 *   mac  = fmaf((float)M, dmin_n * d_m, mac)            (Q4_K, Q5_K; Q6_K has no minimums)
 * per output n, row m and super-block b, in that order (the scalar reference `q_k_tiles_ref_block`,
 * which the tile path follows); the output is acc - mac. On the tiles, per 64 inputs, four
 * products of 16 rows by 16 outputs: hi x Wl (tdpbsud), lo x Wl (tdpbuud), hi x Wh (tdpbssd),
 * lo x Wh (tdpbusd).
 * The weights are laid out as the tiles take them (four consecutive inputs of each of 16 outputs
 * a 64-byte row), gathered, scaled and split once a super-block for all of a group's rows.
 *
 * `tiles_ready` asks once whether the process may run them (amx.c: cpuid, XCR0, arch_prctl).
 *
 * Included by layers.c after q_k_int16.c and amx.c.
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
    float *fb;      /* with steps, bsums as floats (exact: |bsum| <= 32 * 32767), for the minimums' products
                       to broadcast from memory (converted once, not in every product) */
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

static void q_k_tiles_ref_block(int type, const uint8_t *blk, const struct tile_acts *a, int s, int b, int K, float *acc, float *mac) {
    int nb = K / 256;
    const int32_t *bsum = a->bsums + ((int64_t)s * nb + b) * 8;
    int32_t hh = 0, hl = 0, lh = 0, ll = 0, M = 0;
    for (int e = 0; e < 256; e++) {
        int W = q_k_int16_weight_ref(type, blk, e), hi = a->hi[tile_at(a, s, b, e)], lo = a->lo[tile_at(a, s, b, e)];
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
static INLINE TILE_TARGET void q_k_tiles_amx_weights(int type, const uint8_t *base, __m512i vidx, uint8_t Wl[4][1024], uint8_t Wh[4][1024],
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
static TILE_TARGET void q_k_tiles_amx(const struct part *p, int64_t r0, int64_t r1, const struct tile_acts *a, int s0, int g,
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
        q_k_tiles_amx_weights(p->type, base, vidx, Wl, Wh, &dv, &dmv, mn);
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
