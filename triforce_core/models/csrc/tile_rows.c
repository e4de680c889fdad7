/* A prefill's Q4_K products on AMX tiles: `int8.TILES`.
 *
 * Why a prefill only: a prefill multiplies every weight by hundreds of rows, where AMX's tile
 * products (a 16 x 16 block of int32 sums over 64 bytes in one instruction) leave the vector
 * units only the bookkeeping. A step or a verification keeps int16_rows.c's order: their rows
 * must equal each other bit for bit, and a tile's sums come out per sub-block, not in that
 * order's lanes. A prefill's rows only have to be the same whatever rows come with them, which
 * these are (each row quantized on its own, every output in one order).
 *
 * The activations are int16_rows.c's (struct block_q16_k, the same quantization), each q split
 * exactly into q = 256 hi + lo, hi signed (-128..127), lo unsigned (0..255); a Q4_K weight
 * w (0..15) is a signed byte. Per output n, row m and super-block b, in this order (the scalar
 * reference `ref_tile_block`, which the tile path follows):
 *   S_j = sum of w_e q_e over sub-block j's 32 inputs      exact: |S_j| <= 32 x 15 x 32767 < 2^24
 *   Q_p = sc_2p S_2p + sc_2p+1 S_2p+1                        exact: < 2 x 63 x 2^24 < 2^31
 *   F   = ((float)Q_0 + (float)Q_1) + ((float)Q_2 + (float)Q_3)
 *   acc = fmaf(F, d_n * d_m, acc)
 *   M   = sum of m_j bsum_j over j                            exact: < 8 x 63 x 32 x 32767 < 2^31
 *   mac = fmaf((float)M, dmin_n * d_m, mac)
 * and the output is acc - mac. On the tiles: per sub-block one tdpbssd (hi) and one tdpbusd (lo)
 * of 16 rows by 16 outputs; the weights are laid out as the tiles take them (four consecutive
 * inputs of each of 16 outputs a 64-byte row) by one gather per four inputs, once a super-block
 * for all of a group's rows.
 *
 * The tiles run only after the process asks the kernel for their state (arch_prctl
 * ARCH_REQ_XCOMP_PERM): without it the first tile instruction faults. `tiles_ready` asks once,
 * after the processor says it has them (cpuid) and the system saves their state (XCR0).
 *
 * Included by layers.c after int16_rows.c.
 */

#if defined(__x86_64__) && defined(__linux__) && defined(__GNUC__) && __GNUC__ >= 11
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#define TILES_X86 1
#define TILE_TARGET __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni,amx-tile,amx-int8")))
#endif

#define TILE_M 16      /* rows of a tile product */
#define TILE_GROUP 128 /* rows sharing one super-block's weights in tiles (a multiple of TILE_M) */

/* A prefill's rows as the tiles take them: S_pad = S rounded up to TILE_M rows (the rest zero). */
struct tile_acts {
    int8_t *hi;     /* [K / 32, S_pad, 32]: q >> 8, each sub-block's rows together (a tile's 16 rows are 512 bytes in a row) */
    uint8_t *lo;    /* [K / 32, S_pad, 32]: q & 255 */
    int32_t *bsums; /* [S_pad, K / 256, 8]: sum of q per 32 inputs */
    float *d;       /* [S_pad, K / 256]: the block's scale */
    int S_pad;
};

static void tile_acts_free(struct tile_acts *a) {
    free(a->hi);
    free(a->lo);
    free(a->bsums);
    free(a->d);
}

/* Where input e of super-block b of row s is in a's hi and lo. */
static inline int64_t tile_at(const struct tile_acts *a, int s, int b, int e) {
    return ((int64_t)(8 * b + e / 32) * a->S_pad + s) * 32 + e % 32;
}

/* Row s of xw (K / 256 blocks) into a's row s. */
static void tile_acts_row(const struct block_q16_k *xw, int K, int s, struct tile_acts *a) {
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

/* ---- the scalar reference ---------------------------------------------------------------- */

static void ref_tile_block(const uint8_t *blk, const struct tile_acts *a, int s, int b, int K, float *acc, float *mac) {
    int nb = K / 256;
    const int32_t *bsum = a->bsums + ((int64_t)s * nb + b) * 8;
    const uint8_t *qs = blk + 16;
    int32_t Q[4], M = 0;
    for (int p = 0; p < 4; p++) {
        Q[p] = 0;
        for (int h = 0; h < 2; h++) {
            int j = 2 * p + h, sc, m, S = 0;
            scale_min_k4(j, blk + 4, &sc, &m);
            for (int i = 0; i < 32; i++) {
                int w = h ? qs[32 * p + i] >> 4 : qs[32 * p + i] & 15, e = 32 * j + i;
                S += w * (256 * a->hi[tile_at(a, s, b, e)] + a->lo[tile_at(a, s, b, e)]);
            }
            Q[p] += sc * S;
            M += m * bsum[j];
        }
    }
    float F = ((float)Q[0] + (float)Q[1]) + ((float)Q[2] + (float)Q[3]);
    float dx = a->d[(int64_t)s * nb + b];
    *acc = fmaf(F, half_at(blk) * dx, *acc);
    *mac = fmaf((float)M, half_at(blk + 2) * dx, *mac);
}

static void ref_tile_outputs(const struct part *p, int64_t r0, int64_t r1, const struct tile_acts *a, int s0, int g, int K,
                             float *y, int64_t ldy) {
    for (int64_t r = r0; r < r1; r++)
        for (int s = s0; s < s0 + g; s++) {
            float acc = 0.0f, mac = 0.0f;
            for (int b = 0; b < K / 256; b++) ref_tile_block((const uint8_t *)p->data + r * p->ld + (int64_t)b * 144, a, s, b, K, &acc, &mac);
            y[(int64_t)(s - s0) * ldy + r] = acc - mac;
        }
}

/* ---- the tiles ---------------------------------------------------------------------------- */

static int tiles_state = -1; /* -1: not asked yet */

/* Whether AMX's integer tiles run in this process (asking the kernel for their state once). */
static int tiles_ready(void) {
    if (tiles_state >= 0) return tiles_state;
    int ok = 0;
#ifdef TILES_X86
    unsigned a, b, c, d;
    if (int8_runs(INT8_AVX512_VNNI) && __get_cpuid_count(7, 0, &a, &b, &c, &d) && (d >> 24 & 1) && (d >> 25 & 1) &&
        __get_cpuid(1, &a, &b, &c, &d) && (c >> 27 & 1)) {
        unsigned lo32, hi32;
        __asm__ volatile("xgetbv" : "=a"(lo32), "=d"(hi32) : "c"(0));
        /* XCR0 bits 17 (TILECFG) and 18 (TILEDATA): the system saves the tiles' state */
        if ((lo32 >> 17 & 3) == 3) ok = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
    }
#endif
    tiles_state = ok;
    return ok;
}

#ifdef TILES_X86
struct tile_config {
    uint8_t palette;
    uint8_t start_row;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};

/* Tiles 0 and 1: a sub-block's hi and lo of 16 rows (32 bytes each); 2: its weights, 16 outputs
 * (eight rows of four inputs each); 3 and 4: the int32 sums of hi and of lo, 16 rows x 16 outputs. */
static TILE_TARGET void tile_configure(void) {
    struct tile_config c;
    memset(&c, 0, sizeof(c));
    c.palette = 1;
    c.rows[0] = c.rows[1] = 16, c.colsb[0] = c.colsb[1] = 32;
    c.rows[2] = 8, c.colsb[2] = 64;
    c.rows[3] = c.rows[4] = 16, c.colsb[3] = c.colsb[4] = 64;
    _tile_loadconfig(&c);
}

/* Byte i of each lane. */
static INLINE TILE_TARGET __m512i byte_of(__m512i v, int i) { return _mm512_and_si512(_mm512_srli_epi32(v, 8 * i), _mm512_set1_epi32(255)); }

/* Outputs [r0, r0 + 16) (those below r1 written) of a Q4_K part against rows [s0, s0 + g) of a. */
static TILE_TARGET void amx_tile_outputs(const struct part *p, int64_t r0, int64_t r1, const struct tile_acts *a, int s0, int g,
                                         int K, float *y, int64_t ldy) {
    const int nb = K / 256, gp = (g + TILE_M - 1) / TILE_M * TILE_M, count = (int)(r1 - r0);
    float acc[TILE_GROUP][16] __attribute__((aligned(64))), mac[TILE_GROUP][16] __attribute__((aligned(64)));
    uint8_t B[8][512] __attribute__((aligned(64)));
    int32_t H[8][16][16] __attribute__((aligned(64))), L[8][16][16] __attribute__((aligned(64)));
    int32_t off[16];
    for (int n = 0; n < 16; n++) off[n] = (int32_t)((n < count ? n : count - 1) * p->ld);  /* past r1: the last output again */
    const __m512i vidx = _mm512_loadu_si512((const void *)off), nib = _mm512_set1_epi32(0x0F0F0F0F);
    for (int t = 0; t < gp; t++) {
        _mm512_store_ps(acc[t], _mm512_setzero_ps());
        _mm512_store_ps(mac[t], _mm512_setzero_ps());
    }
    tile_configure();
    for (int b = 0; b < nb; b++) {
        const uint8_t *base = (const uint8_t *)p->data + r0 * p->ld + (int64_t)b * 144;
        /* the 16 outputs' scales: d and dmin, then the six-bit sc_j and m_j (scale_min_k4) */
        __m512i w0 = _mm512_i32gather_epi32(vidx, (const void *)base, 1);
        __m512 dv = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(w0)), dmv = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(w0, 16)));
        __m512i D0 = _mm512_i32gather_epi32(vidx, (const void *)(base + 4), 1);
        __m512i D1 = _mm512_i32gather_epi32(vidx, (const void *)(base + 8), 1);
        __m512i D2 = _mm512_i32gather_epi32(vidx, (const void *)(base + 12), 1);
        __m512i sc[8], mn[8];
        const __m512i six = _mm512_set1_epi32(63), four = _mm512_set1_epi32(15);
        for (int j = 0; j < 4; j++) {
            sc[j] = _mm512_and_si512(byte_of(D0, j), six);
            mn[j] = _mm512_and_si512(byte_of(D1, j), six);
            sc[j + 4] = _mm512_or_si512(_mm512_and_si512(byte_of(D2, j), four), _mm512_slli_epi32(_mm512_srli_epi32(byte_of(D0, j), 6), 4));
            mn[j + 4] = _mm512_or_si512(_mm512_srli_epi32(byte_of(D2, j), 4), _mm512_slli_epi32(_mm512_srli_epi32(byte_of(D1, j), 6), 4));
        }
        /* the weights as the tiles take them: B[j] row k4 = inputs 4 k4 .. 4 k4 + 3 of sub-block j, per output */
        for (int q = 0; q < 4; q++)
            for (int k4 = 0; k4 < 8; k4++) {
                __m512i R = _mm512_i32gather_epi32(vidx, (const void *)(base + 16 + 32 * q + 4 * k4), 1);
                _mm512_store_si512((void *)(B[2 * q] + 64 * k4), _mm512_and_si512(R, nib));
                _mm512_store_si512((void *)(B[2 * q + 1] + 64 * k4), _mm512_and_si512(_mm512_srli_epi32(R, 4), nib));
            }
        for (int t0 = 0; t0 < gp; t0 += TILE_M) {
            for (int j = 0; j < 8; j++) {
                const int64_t at = tile_at(a, s0 + t0, b, 32 * j);
                _tile_loadd(0, a->hi + at, 32);
                _tile_loadd(1, a->lo + at, 32);
                _tile_loadd(2, B[j], 64);
                _tile_zero(3);
                _tile_zero(4);
                _tile_dpbssd(3, 0, 2);
                _tile_dpbusd(4, 1, 2);
                _tile_stored(3, H[j], 64);
                _tile_stored(4, L[j], 64);
            }
            for (int m = 0; m < TILE_M && t0 + m < g; m++) {
                const int s = s0 + t0 + m;
                __m512 f[4];
                for (int q = 0; q < 4; q++) {
                    __m512i S0 = _mm512_add_epi32(_mm512_slli_epi32(_mm512_load_si512((const void *)H[2 * q][m]), 8),
                                                  _mm512_load_si512((const void *)L[2 * q][m]));
                    __m512i S1 = _mm512_add_epi32(_mm512_slli_epi32(_mm512_load_si512((const void *)H[2 * q + 1][m]), 8),
                                                  _mm512_load_si512((const void *)L[2 * q + 1][m]));
                    f[q] = _mm512_cvtepi32_ps(_mm512_add_epi32(_mm512_mullo_epi32(S0, sc[2 * q]), _mm512_mullo_epi32(S1, sc[2 * q + 1])));
                }
                __m512 F = _mm512_add_ps(_mm512_add_ps(f[0], f[1]), _mm512_add_ps(f[2], f[3]));
                const int32_t *bsum = a->bsums + ((int64_t)s * nb + b) * 8;
                __m512i M = _mm512_mullo_epi32(mn[0], _mm512_set1_epi32(bsum[0]));
                for (int j = 1; j < 8; j++) M = _mm512_add_epi32(M, _mm512_mullo_epi32(mn[j], _mm512_set1_epi32(bsum[j])));
                const __m512 dx = _mm512_set1_ps(a->d[(int64_t)s * nb + b]);
                _mm512_store_ps(acc[t0 + m], _mm512_fmadd_ps(F, _mm512_mul_ps(dv, dx), _mm512_load_ps(acc[t0 + m])));
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

/* Outputs [r0, r1) (at most 16) of a Q4_K part against rows [s0, s0 + g) of a, g <= TILE_GROUP:
 * y[(s - s0) * ldy + r]. The tiles where they run and the path is the widest, else the reference. */
static void tile_outputs(const struct part *p, int64_t r0, int64_t r1, const struct tile_acts *a, int s0, int g, int K, float *y,
                         int64_t ldy, int path) {
#ifdef TILES_X86
    if (path == INT8_AVX512_VNNI && tiles_ready()) {
        amx_tile_outputs(p, r0, r1, a, s0, g, K, y, ldy);
        return;
    }
#endif
    (void)path;
    ref_tile_outputs(p, r0, r1, a, s0, g, K, y, ldy);
}

/* Whether this process runs the tiles (for int8.py: the prefill takes TILES only then). */
int int8_tiles(void) { return tiles_ready() && int8_path() == INT8_AVX512_VNNI; }
