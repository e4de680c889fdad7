/* Steps' and verifications' products of the 256-weight types (Q4_K, Q5_K, Q6_K) in one order
 * on VNNI and AMX's tiles: `int8.STEP_TILES`.
 *
 * A step's or a verification's products on the tiles must cost about what a step's do on
 * VNNI, and every row count must sum in one order (so a verification's row equals its step).
 * The prefill's order above scales each weight by its sub-block's scale and splits it before
 * the tiles take it: per call, more work than a step's whole product. Here the tiles take the
 * weights as stored (Q4_K's 4-bit w, 0..15; Q5_K's 5-bit, 0..31; Q6_K's 6-bit less 32),
 * gathered for 16 outputs by a transposition of contiguous loads, and the scales apply to each
 * sub-block's sums after (for Q4_K and Q5_K, as written here):
 *   S_j = sum of q_e w_e over sub-block j's 32 inputs   exact: |S_j| <= 32 * 32767 * 31 < 2^25
 *   F   = fmaf((float)S_j, (float)sc_j, F) for j = 0..7, from F = 0
 *   acc = fmaf(F, d_n * d_m, acc)
 *   M   = fmaf((float)m_j, (float)bsum_j, M) for j = 0..7, from M = 0
 *   mac = fmaf(M, dmin_n * d_m, mac)
 * per output n, row m and super-block b in that order (`q_k_steps_ref_block`, which the tile path
 * follows lane for lane); the output is acc - mac. On the tiles one signed product a sub-block
 * gives every S_j of up to STEP_ROWS rows: the A tile holds each row's hi, its lo less 128 (both
 * signed bytes), and a row of ones, so that S_j = 256 C_hi + C_lo' + 128 C_ones (`step_acts`).
 * Each output of a tile product is formed on its own, so a row does not depend on the rows
 * beside it. Q6_K the same way over its 16 sub-blocks of 16 inputs, with its signed weights less
 * 32 and its signed scales, no minimums (`q6_k_steps_ref_block`).
 *
 * Up to VNNI_STEP_ROWS rows take VNNI in this order (16 outputs in the lanes), more the tiles;
 * where the tiles do not run, the scalar reference (`q_k_tiles_ref`, the tests' way to
 * check it). Included by layers.c after q_k_tiles.c (the activations' layout, `tiles_ready`). */

/* Rows a group of the steps' kernel takes: 2 * 7 + 1 tile rows. */
#define STEP_ROWS 7

static inline int step_type(int type) { return type == T_Q4_K || type == T_Q5_K || type == T_Q6_K; }

/* Rows up to which a call takes VNNI (`q_k_steps_vnni`) in this order, not the tiles. */
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
static void q6_k_steps_ref_block(const uint8_t *blk, const struct tile_acts *a, int s, int b, int K, float *acc) {
    float F = 0.0f;
    for (int j = 0; j < 16; j++) {
        int32_t S = 0;
        for (int e = 16 * j; e < 16 * j + 16; e++)
            S += (256 * a->hi[tile_at(a, s, b, e)] + a->lo[tile_at(a, s, b, e)]) * ref_step_weight6(blk, e);
        F = fmaf((float)S, (float)(int8_t)blk[192 + j], F);
    }
    *acc = fmaf(F, half_at(blk + 208) * a->d[(int64_t)s * (K / 256) + b], *acc);
}

static void q_k_steps_ref_block(int type, const uint8_t *blk, const struct tile_acts *a, int s, int b, int K, float *acc, float *mac) {
    if (type == T_Q6_K) {
        q6_k_steps_ref_block(blk, a, s, b, K, acc);
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

/* The scalar reference of either order (a->steps: the steps', else a prefill's `q_k_tiles_ref_block`). */
static void q_k_tiles_ref(const struct part *p, int64_t r0, int64_t r1, const struct tile_acts *a, int s0, int g, int K,
                             float *y, int64_t ldy) {
    int bb = block_bytes(p->type);
    void (*block)(int, const uint8_t *, const struct tile_acts *, int, int, int, float *, float *) =
        a->steps ? q_k_steps_ref_block : q_k_tiles_ref_block;
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
 * asks for the next job's 16 a few at a time, spread over a super-block's work: requests in a
 * burst at its start stalled on the queue of misses. Into the second level, not the first: a
 * forward's weights come from memory, where the first level loses (`bench.int8_rows --matrices
 * 19`, `bench.kernel_ab --base`). */
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
 * tiles' fixed costs (the weights and the sums through memory) do not pay for so few rows
 * (`python -m bench.int8_rows --matrices 19`). Outputs [r0, r0 + 16), those
 * below r1 written; x the rows' K / 256 blocks each, y their outputs ldy apart. */
static INLINE TILE_TARGET void q4_k_q5_k_steps_vnni(const struct part *p, int64_t r0, int64_t r1, const struct block_q16_k *x, int K,
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

/* q4_k_q5_k_steps_vnni for Q6_K: 16 sub-blocks of 16 inputs, each finished (its float product added in
 * order) as soon as its 32-input group is. */
static INLINE TILE_TARGET void q6_k_steps_vnni(const struct part *p, int64_t r0, int64_t r1, const struct block_q16_k *x, int K,
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

/* q4_k_q5_k_steps_vnni compiled for each row count (its sums stay in registers). */
static TILE_TARGET void q_k_steps_vnni(const struct part *p, int64_t r0, int64_t r1, const struct block_q16_k *x, int K,
                                          float *y, int64_t ldy, int R) {
    if (p->type == T_Q6_K) {
        switch (R) {
        case 1: q6_k_steps_vnni(p, r0, r1, x, K, y, ldy, 1); break;
        case 2: q6_k_steps_vnni(p, r0, r1, x, K, y, ldy, 2); break;
        default: q6_k_steps_vnni(p, r0, r1, x, K, y, ldy, 3); break;
        }
        return;
    }
    switch (R) {
    case 1: q4_k_q5_k_steps_vnni(p, r0, r1, x, K, y, ldy, 1); break;
    case 2: q4_k_q5_k_steps_vnni(p, r0, r1, x, K, y, ldy, 2); break;
    default: q4_k_q5_k_steps_vnni(p, r0, r1, x, K, y, ldy, 3); break;
    }
}

/* q_k_steps_amx for Q6_K: a tile product a sub-block of 16 inputs (A tiles of 16 bytes a
 * row, B tiles of 4 rows: four inputs of 16 outputs each), its weights less 32 signed, no
 * minimums; the super-blocks pipelined as there. */
static TILE_TARGET void q6_k_steps_amx(const struct part *p, int64_t r0, int64_t r1, const struct tile_acts *a, int s0, int g,
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
static TILE_TARGET void q_k_steps_amx(const struct part *p, int64_t r0, int64_t r1, const struct tile_acts *a, int s0, int g,
                                         int K, float *y, int64_t ldy) {
    if (p->type == T_Q6_K) {
        q6_k_steps_amx(p, r0, r1, a, s0, g, K, y, ldy);
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
            q_k_steps_amx(p, r0, r1, a, s0, g, K, y, ldy);
        else
            q_k_tiles_amx(p, r0, r1, a, s0, g, K, y, ldy);
        return;
    }
#endif
    (void)path;
    q_k_tiles_ref(p, r0, r1, a, s0, g, K, y, ldy);
}

/* Whether this process runs the tiles (for int8.py: the prefill takes TILES only then). */
int int8_tiles(void) { return tiles_ready() && int8_path() == INT8_AVX512_VNNI; }
