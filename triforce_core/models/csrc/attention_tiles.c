/* Few-row attention on AMX's bfloat16 tiles: every row's products at once (opt-in,
 * `native_attention.TILES_ENV`). Included by few_rows.c, whose jobs, blocks and outputs it
 * shares.
 *
 * Where AMX's bfloat16 tiles run (after the process asks for their state), a block's scores and
 * its weighted sum are tile products, and their cost hardly depends on the rows: a 16-row tile
 * product takes one instruction, so a verification's 28 rows cost about what a step's 4 do,
 * where few_rows.c's float32 path does seven times the multiply-adds for seven tokens.
 *
 * Exactness of the parts. A tile product multiplies bfloat16 pairs (8-bit significands) into
 * float32 sums. A float16 key or value (11 bits) is split exactly into hi + lo, hi its float32's
 * top 16 bits (truncated) and lo the rest (at most 3 bits, exact in bfloat16). A query (float32)
 * and a probability are split the same way with lo rounded to bfloat16: 16 of their 24 bits, a
 * relative error below 2^-16, next to the 2^-11 of the float16 cache. Each dword of a tile holds
 * one element's pair (lo in its low half, hi in its high half) against the other side's part
 * twice, so one instruction sums lo x part + hi x part:
 *   score[t][r] = sum over 16-dim pieces j of (K_j . qhi_j) then (K_j . qlo_j)
 *   out[r][d]   = sum over 16-key groups g of (P_g . Vhi_g) then (P_g . Vlo_g)
 * in that order for every row and every key: a row's result does not depend on the rows beside
 * it in its tile (each output of a tile product is formed on its own), so a verification row
 * equals the step it replaces, bit for bit, as on the float32 path.
 *
 * The scores come out as S^T (a key per tile row, the query rows across), so the softmax runs
 * down the keys with the rows in vector lanes; the probabilities are transposed once per 16 keys
 * for the weighted sum, whose A operand takes rows.
 *
 * A bfloat16 cache needs no split: its keys and values go to the tiles as stored, half the
 * tile products (`blocks_tiles_bf16_cache`, head sizes a multiple of 32).
 *
 * Measured on a 2-core Xeon (docs: Results), 8 KV heads of 64: over a float16 cache, 28 rows
 * over 32K keys 0.64-0.71x the float32 path's time, but 4 rows (a step) 1.6-2.1x, the splits of
 * the keys and values (per cached element, whatever the rows) not keeping up with the memory's
 * stream; over a bfloat16 cache 28 rows 0.50x and 4 rows 1.1x. Hence opt-in. */
#ifdef AMX_X86
#define ATT_TILES 1
#define ATT_TARGET __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512dq,avx512vl,amx-tile,amx-bf16")))
#endif

static int att_tiles_state = -1; /* -1: not asked yet */
static int att_tiles_on = 0;

/* Whether AMX's bfloat16 tiles run in this process (asking the kernel for their state once). */
static int att_tiles_run(void) {
    if (att_tiles_state >= 0) return att_tiles_state;
    int ok = 0;
#ifdef ATT_TILES
    unsigned a, b, c, d;
    ok = __get_cpuid(1, &a, &b, &c, &d) && (c >> 29 & 1) &&                     /* F16C */
         __get_cpuid_count(7, 0, &a, &b, &c, &d) && (b >> 16 & 1) && (b >> 17 & 1) &&
         (b >> 30 & 1) && (b >> 31 & 1) &&                                        /* AVX-512 F, DQ, BW, VL */
         amx_has(22) && amx_has(24) && amx_permitted(1);                         /* AMX-BF16, AMX-TILE */
#endif
    att_tiles_state = ok;
    return ok;
}

/* Tiles on (want != 0, where they run) or off for the calls that follow; returns whether on. */
int attention_tiles(int want) {
    att_tiles_on = want && att_tiles_run();
    return att_tiles_on;
}

#ifdef ATT_TILES
#define TQ 16 /* rows (query rows, keys) of a tile */

/* Each lane's pair: its top 16 bits (hi, truncated) in the high half, the rest rounded to
 * bfloat16 (lo, exact when it fits) in the low half. */
INLINE ATT_TARGET __m512i split_pair(__m512 a) {
    __m512i hi = _mm512_and_si512(_mm512_castps_si512(a), _mm512_set1_epi32((int)0xffff0000u));
    __m512i r = _mm512_castps_si512(_mm512_sub_ps(a, _mm512_castsi512_ps(hi)));
    r = _mm512_add_epi32(r, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), _mm512_and_si512(_mm512_srli_epi32(r, 16),
                                                                                          _mm512_set1_epi32(1))));
    return _mm512_or_si512(hi, _mm512_srli_epi32(r, 16));
}

/* The pair's hi (high = 1) or lo half in both halves of each lane. */
INLINE ATT_TARGET __m512i twice(__m512i pair, const int high) {
    __m512i x = high ? _mm512_srli_epi32(pair, 16) : _mm512_and_si512(pair, _mm512_set1_epi32(0xffff));
    return _mm512_or_si512(x, _mm512_slli_epi32(x, 16));
}

/* split_pair of a widened 16-bit key or value, whose lo is exact (its low 16 bits zero): no
 * rounding step. split_exact_twice gives hi and lo each twice in its lane (the values' B operand). */
INLINE ATT_TARGET __m512i split_exact(__m512 a) {
    __m512i hi = _mm512_and_si512(_mm512_castps_si512(a), _mm512_set1_epi32((int)0xffff0000u));
    __m512i lo = _mm512_castps_si512(_mm512_sub_ps(a, _mm512_castsi512_ps(hi)));
    return _mm512_or_si512(hi, _mm512_srli_epi32(lo, 16));
}

INLINE ATT_TARGET void split_exact_twice(__m512 a, __m512i *hi2, __m512i *lo2) {
    __m512i hi = _mm512_and_si512(_mm512_castps_si512(a), _mm512_set1_epi32((int)0xffff0000u));
    __m512i lo = _mm512_castps_si512(_mm512_sub_ps(a, _mm512_castsi512_ps(hi)));
    *hi2 = _mm512_or_si512(hi, _mm512_srli_epi32(hi, 16));
    *lo2 = _mm512_or_si512(lo, _mm512_srli_epi32(lo, 16));
}

/* 16 keys' or values' elements from element i, as float32 (exact). */
INLINE ATT_TARGET __m512 load16(const void *p, int64_t i, const int kind) {
    __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)p + i));
    if (kind == KV_F16) return _mm512_cvtph_ps(h);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

INLINE ATT_TARGET __m512 exp_nonpositive16(__m512 x) { EXP_NONPOSITIVE_VECTOR(512, FLOOR512) }

/* r[i][j] <- r[j][i] for 16 vectors of 16 dwords. */
INLINE ATT_TARGET void transpose16(__m512i r[16]) {
    __m512i t[16];
    for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; i++) {
        r[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
        r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
        r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
        r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
    }
    for (int h = 0; h < 16; h += 8)
        for (int i = 0; i < 4; i++) {
            t[h + i] = _mm512_shuffle_i32x4(r[h + i], r[h + i + 4], 0x88);
            t[h + i + 4] = _mm512_shuffle_i32x4(r[h + i], r[h + i + 4], 0xdd);
        }
    for (int i = 0; i < 8; i++) {
        r[i] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0x88);
        r[i + 8] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0xdd);
    }
}

/* A thread's scratch buffer `which` of at least `words` dwords, 64-byte aligned, kept for its
 * next calls (a fresh one of a few hundred KB each call cost page faults every layer); NULL
 * when it cannot be had. Buffer 0 is a job's, 1 the queries' tiles of the calling thread. */
static __thread uint32_t *tile_buffers[2];
static __thread size_t tile_buffer_words[2];

static uint32_t *tile_scratch(int which, size_t words) {
    if (tile_buffer_words[which] < words) {
        free(tile_buffers[which]);
        size_t n = (words + 15) / 16 * 16;
        tile_buffers[which] = aligned_alloc(64, n * 4);
        tile_buffer_words[which] = tile_buffers[which] ? n : 0;
    }
    return tile_buffers[which];
}

/* The queries as the scores' B operand: qt[h][c][j][part][k][n] = query row c*16+n's dim j*16+k,
 * part 0 hi and 1 lo, twice in its dword (zero for rows past R). */
static ATT_TARGET void tile_queries(const float *q, int H, int R, int D, int CT, uint32_t *qt) {
    int J = D / TQ;
    memset(qt, 0, sizeof(uint32_t) * (size_t)H * CT * J * 2 * TQ * TQ);
    __m512i down = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                      _mm512_set1_epi32(TQ));
    for (int h = 0; h < H; h++)
        for (int r = 0; r < R; r++)
            for (int j = 0; j < J; j++) {
                __m512i pair = split_pair(_mm512_loadu_ps(q + ((int64_t)h * R + r) * D + j * TQ));
                uint32_t *tile = qt + ((((int64_t)h * CT + r / TQ) * J + j) * 2) * TQ * TQ + r % TQ;
                _mm512_i32scatter_epi32(tile, down, twice(pair, 1), 4);
                _mm512_i32scatter_epi32(tile + TQ * TQ, down, twice(pair, 0), 4);
            }
}

/* Tiles 0 .. count-1 (count <= 4) stored `apart` floats from each other from `to`, rows
 * `stride` bytes apart: four groups of 16 keys' scores, or four 16-dim pieces of an output. */
INLINE ATT_TARGET void store_four(float *to, int64_t apart, int stride, int count) {
    if (count > 0) _tile_stored(0, to, stride);
    if (count > 1) _tile_stored(1, to + apart, stride);
    if (count > 2) _tile_stored(2, to + 2 * apart, stride);
    if (count > 3) _tile_stored(3, to + 3 * apart, stride);
}

/* The next job's keys and values not yet asked for. */
struct ahead { const char *k, *k_end, *v, *v_end; };

/* Up to `lines` more of them (half keys, half values) asked for into the level-2 cache. */
static inline void ahead_lines(struct ahead *a, int lines) {
    for (int i = 0; i < lines; i += 2) {
        if (a->k < a->k_end) __builtin_prefetch(a->k, 0, 1), a->k += 64;
        if (a->v < a->v_end) __builtin_prefetch(a->v, 0, 1), a->v += 64;
    }
}

/* Step 3's softmax for column tile c of a block's scores S^T (st, R16 floats a key), down the
 * keys with the rows in lanes: the visible keys' max, their exponentials in place (zero where
 * not visible) and sums, each chunk's sum; the block's m and l (at `stat`). With `nx`,
 * `per_key` of the next job's lines asked for a key. */
INLINE ATT_TARGET void softmax_down_keys(float *st, int R16, int c, int R, const int64_t *limit, int64_t T, int64_t t0, int n,
                                         int n16, int64_t h, int64_t stat, int chunk, int64_t n_chunks, float *chunk_sum,
                                         float *m_out, float *l_out, struct ahead *nx, int per_key) {
    int32_t lim[TQ];
    for (int i = 0; i < TQ; i++) {
        int r = c * TQ + i;
        int64_t x = r < R ? (limit ? limit[r] : T) - t0 : n;
        lim[i] = x <= 0 ? 0 : x < n ? (int32_t)x : n;
    }
    __m512i limv = _mm512_loadu_si512(lim);
    __m512 m = _mm512_set1_ps(-INFINITY);
    for (int t = 0; t < n; t++) {
        __mmask16 seen = _mm512_cmpgt_epi32_mask(limv, _mm512_set1_epi32(t));
        m = _mm512_mask_max_ps(m, seen, m, _mm512_loadu_ps(st + (int64_t)t * R16 + c * TQ));
    }
    __m512 l = _mm512_setzero_ps(), cs = _mm512_setzero_ps();
    for (int t = 0; t < n16; t++) {
        float *sp = st + (int64_t)t * R16 + c * TQ;
        __mmask16 seen = _mm512_cmpgt_epi32_mask(limv, _mm512_set1_epi32(t));
        __m512 e = _mm512_maskz_mov_ps(seen, exp_nonpositive16(_mm512_sub_ps(_mm512_loadu_ps(sp), m)));
        _mm512_storeu_ps(sp, e);
        l = _mm512_add_ps(l, e);
        if (nx) ahead_lines(nx, per_key);
        if (chunk_sum && t < n) {
            cs = _mm512_add_ps(cs, e);
            if ((t + 1) % chunk == 0) {
                int64_t ci = (t0 + t) / chunk;
                if (ci < n_chunks) {
                    float lanes[TQ];
                    _mm512_storeu_ps(lanes, cs);
                    for (int i = 0; i < TQ && c * TQ + i < R; i++)
                        chunk_sum[((int64_t)h * R + c * TQ + i) * n_chunks + ci] = lanes[i];
                }
                cs = _mm512_setzero_ps();
            }
        }
    }
    float ml[TQ], ll[TQ];
    _mm512_storeu_ps(ml, m);
    _mm512_storeu_ps(ll, l);
    for (int i = 0; i < TQ && c * TQ + i < R; i++) {
        m_out[stat + c * TQ + i] = ml[i];
        l_out[stat + c * TQ + i] = ll[i];
    }
}

/* `blocks` on the tiles (K/V float16 or bfloat16, D % 16 == 0): the same jobs and outputs. */
INLINE ATT_TARGET int blocks_tiles(const uint32_t *qt, const void *k, const void *v, int64_t head_stride, int H, int R,
                                   int D, int64_t T, const int64_t *limit, int block, int64_t job_begin,
                                   int64_t job_end, float *out, float *m_out, float *l_out, int chunk,
                                   float *chunk_sum, const int kind) {
    (void)H;
    const int CT = (R + TQ - 1) / TQ, R16 = CT * TQ, J = D / TQ, B16 = (block + TQ - 1) / TQ * TQ;
    int64_t nb = (T + block - 1) / block, n_chunks = chunk > 0 ? T / chunk : 0;
    /* per thread: the block's keys as pairs [B16][D], its values hi and lo twice [B16][D], the
       scores and then probabilities S^T [B16][R16], those as the weighted sum's A tiles
       [CT][B16 / 16][16][16], one partial output [R16][D] */
    size_t words = (size_t)B16 * D * 3 + (size_t)B16 * R16 * 2 + (size_t)R16 * D;
    uint32_t *kc = tile_scratch(0, words);
    if (!kc) return -1;
    uint32_t *vh = kc + (size_t)B16 * D, *vl = vh + (size_t)B16 * D;
    float *st = (float *)(vl + (size_t)B16 * D);
    uint32_t *pa = (uint32_t *)(st + (size_t)B16 * R16);
    float *ot = (float *)(pa + (size_t)B16 * R16);
    amx_configure();
    const int64_t es = kv_size(kind);

    for (int64_t job = job_begin; job < job_end; job++) {
        int64_t h = job / nb, b = job % nb;
        int64_t t0 = b * block;
        int n = (int)((T - t0) < block ? (T - t0) : block), n16 = (n + TQ - 1) / TQ * TQ;
        const char *kh = (const char *)k + (h * head_stride + t0 * D) * es;
        const char *vhd = (const char *)v + (h * head_stride + t0 * D) * es;
        const uint32_t *qh = qt + (int64_t)h * CT * J * 2 * TQ * TQ;
        /* 1. the block's values split into hi and lo, each twice in its dword (rows past n zero);
           meanwhile the next job's keys and values are asked for into the level-2 cache: its
           splits would otherwise wait on the memory (the float path prefetches likewise) */
        const char *nk = NULL, *nv = NULL;
        int nn = 0;
        if (job + 1 < job_end) {
            int64_t h1 = (job + 1) / nb, t1 = (job + 1) % nb * block;
            nn = (int)((T - t1) < block ? (T - t1) : block);
            nk = (const char *)k + (h1 * head_stride + t1 * D) * es;
            nv = (const char *)v + (h1 * head_stride + t1 * D) * es;
        }
        for (int t = 0; t < n; t++) {
            if (t < nn)
                for (int64_t c0 = 0; c0 < D * es; c0 += 64) {
                    __builtin_prefetch(nk + (int64_t)t * D * es + c0, 0, 1);
                    __builtin_prefetch(nv + (int64_t)t * D * es + c0, 0, 1);
                }
            for (int j = 0; j < J; j++) {
                __m512i h2, l2;
                split_exact_twice(load16(vhd, (int64_t)t * D + j * TQ, kind), &h2, &l2);
                _mm512_store_si512(vh + (int64_t)t * D + j * TQ, h2);
                _mm512_store_si512(vl + (int64_t)t * D + j * TQ, l2);
            }
        }
        if (n16 > n) {
            memset(kc + (int64_t)n * D, 0, sizeof(uint32_t) * (size_t)(n16 - n) * D);
            memset(vh + (int64_t)n * D, 0, sizeof(uint32_t) * (size_t)(n16 - n) * D);
            memset(vl + (int64_t)n * D, 0, sizeof(uint32_t) * (size_t)(n16 - n) * D);
        }
        /* 2. scores S^T [n16][R16], a column tile and 64 keys at a time: tiles 0-3 the sums of
           four groups of 16 keys (four independent chains of tile products, where one chain
           waits on each product's latency), 4-5 the keys, 6-7 the queries' hi and lo. The keys
           are split into pairs just before their first column tile reads them (still in the
           first-level cache) */
        for (int c = 0; c < CT; c++) {
            const uint32_t *qc = qh + (int64_t)c * J * 2 * TQ * TQ;
            for (int g = 0; g < n16; g += 4 * TQ) {
                const int ng = (n16 - g) / TQ < 4 ? (n16 - g) / TQ : 4;
                if (c == 0)
                    for (int t = g; t < g + 4 * TQ && t < n; t++)
                        for (int j = 0; j < J; j++)
                            _mm512_store_si512(kc + (int64_t)t * D + j * TQ,
                                               split_exact(load16(kh, (int64_t)t * D + j * TQ, kind)));
                _tile_zero(0);
                _tile_zero(1);
                _tile_zero(2);
                _tile_zero(3);
                for (int j = 0; j < J; j++) {
                    _tile_loadd(6, qc + (int64_t)j * 2 * TQ * TQ, 64);
                    _tile_loadd(7, qc + ((int64_t)j * 2 + 1) * TQ * TQ, 64);
                    const uint32_t *kg = kc + (int64_t)g * D + j * TQ;
#define KEYS(i, a)                                             \
    if (ng > i) {                                              \
        _tile_loadd(a, kg + (int64_t)i * TQ * D, D * 4);       \
        _tile_dpbf16ps(i, a, 6);                               \
        _tile_dpbf16ps(i, a, 7);                               \
    }
                    KEYS(0, 4) KEYS(1, 5) KEYS(2, 4) KEYS(3, 5)
#undef KEYS
                }
                store_four(st + (int64_t)g * R16 + c * TQ, (int64_t)TQ * R16, R16 * 4, ng);
            }
        }
        /* 3. per column tile, down the keys with the rows in lanes: the visible keys' max, their
           exponentials (zero where not visible) and sums, each chunk's sum; then the
           probabilities as pairs, transposed into the weighted sum's A tiles */
        int64_t stat = (h * nb + b) * R;
        for (int c = 0; c < CT; c++) {
            softmax_down_keys(st, R16, c, R, limit, T, t0, n, n16, h, stat, chunk, n_chunks, chunk_sum, m_out, l_out, NULL, 0);
            for (int g = 0; g < n16; g += TQ) {
                __m512i rows[TQ];
                for (int i = 0; i < TQ; i++) rows[i] = split_pair(_mm512_loadu_ps(st + (int64_t)(g + i) * R16 + c * TQ));
                transpose16(rows);
                uint32_t *tile = pa + ((int64_t)c * (B16 / TQ) + g / TQ) * TQ * TQ;
                for (int i = 0; i < TQ; i++) _mm512_store_si512(tile + i * TQ, rows[i]);
            }
        }
        /* 4. the block's partial output [R][D]: tiles 0-3 four 16-dim pieces' sums, 4 the
           probabilities, 5 and 6 the values' hi and lo */
        float *o = out + stat * D;
        for (int c = 0; c < CT; c++) {
            for (int d0 = 0; d0 < J; d0 += 4) {
                const int nd = J - d0 < 4 ? J - d0 : 4;
                _tile_zero(0);
                _tile_zero(1);
                _tile_zero(2);
                _tile_zero(3);
                for (int g = 0; g < n16; g += TQ) {
                    _tile_loadd(4, pa + ((int64_t)c * (B16 / TQ) + g / TQ) * TQ * TQ, 64);
                    const uint32_t *h0 = vh + (int64_t)g * D + d0 * TQ, *l0 = vl + (int64_t)g * D + d0 * TQ;
#define PIECE(i)                                            \
    if (nd > i) {                                           \
        _tile_loadd(5, h0 + i * TQ, D * 4);                 \
        _tile_loadd(6, l0 + i * TQ, D * 4);                 \
        _tile_dpbf16ps(i, 4, 5);                            \
        _tile_dpbf16ps(i, 4, 6);                            \
    }
                    PIECE(0) PIECE(1) PIECE(2) PIECE(3)
#undef PIECE
                }
                store_four(ot + d0 * TQ, TQ, D * 4, nd);
            }
            int rows = R - c * TQ < TQ ? R - c * TQ : TQ;
            memcpy(o + (int64_t)c * TQ * D, ot, sizeof(float) * (size_t)rows * D);
        }
    }
    _tile_release();
    return 0;
}

/* ---- a bfloat16 cache: its keys and values as stored --------------------------------------
 *
 * A bfloat16 key or value is already a tile operand: no split. A tile product then takes
 * bfloat16 pairs of consecutive elements, as the cache holds them:
 *   score[t][r] = sum over 32-dim pieces j of (K_j . qhi_j) then (K_j . qlo_j)
 *     the keys' A tile read straight from the cache (16 keys, 32 dims: 64 bytes a key's row),
 *     the queries' hi and lo parts as B, pairs of consecutive dims (`tile_queries_bf16`);
 *   out[r][d]   = sum over 32-key groups g of (Phi_g . V_g) then (Plo_g . V_g)
 *     the probabilities' hi and lo parts as A, pairs of consecutive keys, and the values as B,
 *     two consecutive keys' elements of a dim in each dword (one permutation a pair of keys).
 * Half the tile products of the split path's and no per-element split: the cache's bytes go
 * to the tiles as they are. Rows stay independent (each output of a tile product is formed on
 * its own), so a verification's row equals its step bit for bit. Head sizes a multiple of 32. */

/* The queries as the scores' B operand over a bfloat16 cache: qt[h][c][j][part][k][n] =
 * query row c*16+n's dims 32j+2k (low half) and 32j+2k+1 (high half), part 0 hi and 1 lo
 * (zero for rows past R). */
static ATT_TARGET void tile_queries_bf16(const float *q, int H, int R, int D, int CT, uint32_t *qt) {
    int J = D / (2 * TQ);
    memset(qt, 0, sizeof(uint32_t) * (size_t)H * CT * J * 2 * TQ * TQ);
    const __m512i down = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                            _mm512_set1_epi32(TQ));
    /* split_pair's words are (lo, hi) per element: the odd words of two registers are 32
       elements' hi, the even ones their lo */
    __m512i odd = _mm512_setzero_si512(), even = _mm512_setzero_si512();
    {
        uint16_t o[32], e[32];
        for (int i = 0; i < 32; i++) o[i] = (uint16_t)(2 * i + 1), e[i] = (uint16_t)(2 * i);
        odd = _mm512_loadu_si512(o);
        even = _mm512_loadu_si512(e);
    }
    for (int h = 0; h < H; h++)
        for (int r = 0; r < R; r++)
            for (int j = 0; j < J; j++) {
                const float *x = q + ((int64_t)h * R + r) * D + j * 2 * TQ;
                __m512i p0 = split_pair(_mm512_loadu_ps(x)), p1 = split_pair(_mm512_loadu_ps(x + TQ));
                uint32_t *tile = qt + ((((int64_t)h * CT + r / TQ) * J + j) * 2) * TQ * TQ + r % TQ;
                _mm512_i32scatter_epi32(tile, down, _mm512_permutex2var_epi16(p0, odd, p1), 4);
                _mm512_i32scatter_epi32(tile + TQ * TQ, down, _mm512_permutex2var_epi16(p0, even, p1), 4);
            }
}

/* `blocks` on the tiles over a bfloat16 cache (D % 32 == 0): the same jobs and outputs. */
static ATT_TARGET int blocks_tiles_bf16_cache(const void *qtv, const void *k, const void *v, int64_t head_stride, int H,
                                              int R, int D, int64_t T, const int64_t *limit, int block,
                                              int64_t job_begin, int64_t job_end, float *out, float *m_out,
                                              float *l_out, int chunk, float *chunk_sum) {
    (void)H;
    const uint32_t *qt = (const uint32_t *)qtv;
    const int CT = (R + TQ - 1) / TQ, R16 = CT * TQ, J = D / (2 * TQ), B32 = (block + 2 * TQ - 1) / (2 * TQ) * (2 * TQ);
    int64_t nb = (T + block - 1) / block, n_chunks = chunk > 0 ? T / chunk : 0;
    /* per thread: the values as key pairs [B32 / 2][D], the scores and then probabilities S^T
       [B32][R16], those as the weighted sum's A tiles (hi, lo) [CT][B32 / 32][2][16][16], one
       partial output [R16][D], a last group's 16 keys zero-padded [16][D / 2] */
    size_t words = (size_t)B32 / 2 * D + (size_t)B32 * R16 * 2 + (size_t)R16 * D + (size_t)TQ * D / 2;
    uint32_t *vi = tile_scratch(0, words);
    if (!vi) return -1;
    float *st = (float *)(vi + (size_t)B32 / 2 * D);
    uint32_t *pa = (uint32_t *)(st + (size_t)B32 * R16);
    float *ot = (float *)(pa + (size_t)B32 * R16);
    uint16_t *ktail = (uint16_t *)(ot + (size_t)R16 * D);
    __m512i lo_pairs, hi_pairs; /* words of two keys' 32 elements: (a_i, b_i) for i < 16, then i >= 16 */
    {
        uint16_t l[32], u[32];
        for (int i = 0; i < 16; i++) l[2 * i] = (uint16_t)i, l[2 * i + 1] = (uint16_t)(32 + i), u[2 * i] = (uint16_t)(16 + i),
                                     u[2 * i + 1] = (uint16_t)(48 + i);
        lo_pairs = _mm512_loadu_si512(l);
        hi_pairs = _mm512_loadu_si512(u);
    }
    amx_configure();

    for (int64_t job = job_begin; job < job_end; job++) {
        int64_t h = job / nb, b = job % nb;
        int64_t t0 = b * block;
        int n = (int)((T - t0) < block ? (T - t0) : block), n16 = (n + TQ - 1) / TQ * TQ,
            n32 = (n + 2 * TQ - 1) / (2 * TQ) * (2 * TQ);
        const uint16_t *kh = (const uint16_t *)k + h * head_stride + t0 * D;
        const uint16_t *vhd = (const uint16_t *)v + h * head_stride + t0 * D;
        const uint32_t *qh = qt + (int64_t)h * CT * J * 2 * TQ * TQ;
        /* The next job's keys and values are asked for into the level-2 cache a few lines a
           key while this one's softmax runs (step 3): asked for all at once, they kept the
           core waiting on the memory, then the memory waiting on the core. */
        struct ahead nx = {NULL, NULL, NULL, NULL};
        int per_key = 0;
        if (job + 1 < job_end) {
            int64_t h1 = (job + 1) / nb, t1 = (job + 1) % nb * block;
            int64_t bytes = (int64_t)((T - t1) < block ? (T - t1) : block) * D * 2;
            nx.k = (const char *)((const uint16_t *)k + h1 * head_stride + t1 * D), nx.k_end = nx.k + bytes;
            nx.v = (const char *)((const uint16_t *)v + h1 * head_stride + t1 * D), nx.v_end = nx.v + bytes;
            per_key = (int)((2 * bytes / 64 + n16 - 1) / n16);
        }
        /* 1. the values as key pairs (keys past n zero: a zero probability times a stale value
           that is not a number would not be zero) */
        for (int t = 0; t < n32; t += 2) {
            uint32_t *row = vi + (int64_t)(t / 2) * D;
            for (int d = 0; d < D; d += 2 * TQ) {
                __m512i a = t < n ? _mm512_loadu_si512(vhd + (int64_t)t * D + d) : _mm512_setzero_si512();
                __m512i c = t + 1 < n ? _mm512_loadu_si512(vhd + (int64_t)(t + 1) * D + d) : _mm512_setzero_si512();
                _mm512_store_si512(row + d, _mm512_permutex2var_epi16(a, lo_pairs, c));
                _mm512_store_si512(row + d + TQ, _mm512_permutex2var_epi16(a, hi_pairs, c));
            }
        }
        /* 2. scores S^T [n16][R16], a column tile and 64 keys at a time: tiles 0-3 four groups
           of 16 keys' sums, 4-5 the keys (from the cache; a last group past n from ktail, zero
           beyond n), 6-7 the queries' hi and lo */
        const int tail = n % TQ ? n / TQ * TQ : -1; /* the first key of a partial group of 16 */
        if (tail >= 0) {
            memset(ktail, 0, sizeof(uint16_t) * (size_t)TQ * D);
            memcpy(ktail, kh + (int64_t)tail * D, sizeof(uint16_t) * (size_t)(n - tail) * D);
        }
        for (int c = 0; c < CT; c++) {
            const uint32_t *qc = qh + (int64_t)c * J * 2 * TQ * TQ;
            for (int g = 0; g < n16; g += 4 * TQ) {
                const int ng = (n16 - g) / TQ < 4 ? (n16 - g) / TQ : 4;
                _tile_zero(0);
                _tile_zero(1);
                _tile_zero(2);
                _tile_zero(3);
                for (int j = 0; j < J; j++) {
                    _tile_loadd(6, qc + (int64_t)j * 2 * TQ * TQ, 64);
                    _tile_loadd(7, qc + ((int64_t)j * 2 + 1) * TQ * TQ, 64);
#define KEYS(i, a)                                                                                       \
    if (ng > i) {                                                                                        \
        const int first = g + i * TQ;                                                                    \
        if (first == tail)                                                                               \
            _tile_loadd(a, ktail + j * 2 * TQ, D * 2);                                                   \
        else                                                                                             \
            _tile_loadd(a, kh + (int64_t)first * D + j * 2 * TQ, D * 2);                                 \
        _tile_dpbf16ps(i, a, 6);                                                                         \
        _tile_dpbf16ps(i, a, 7);                                                                         \
    }
                    KEYS(0, 4) KEYS(1, 5) KEYS(2, 4) KEYS(3, 5)
#undef KEYS
                }
                store_four(st + (int64_t)g * R16 + c * TQ, (int64_t)TQ * R16, R16 * 4, ng);
            }
        }
        /* 3. per column tile, down the keys with the rows in lanes: the visible keys' max, their
           exponentials (zero where not visible, and for the keys past n16 up to n32) and sums,
           each chunk's sum; then the probabilities' hi and lo as key pairs, transposed into the
           weighted sum's A tiles */
        int64_t stat = (h * nb + b) * R;
        for (int c = 0; c < CT; c++) {
            softmax_down_keys(st, R16, c, R, limit, T, t0, n, n16, h, stat, chunk, n_chunks, chunk_sum, m_out, l_out,
                              c == 0 ? &nx : NULL, per_key);
            for (int t = n16; t < n32; t++) _mm512_storeu_ps(st + (int64_t)t * R16 + c * TQ, _mm512_setzero_ps());
            const __m512i low = _mm512_set1_epi32(0xffff), high = _mm512_set1_epi32((int)0xffff0000u);
            for (int g = 0; g < n32; g += 2 * TQ) {
                __m512i his[TQ], los[TQ];
                for (int i = 0; i < TQ; i++) {
                    __m512i a = split_pair(_mm512_loadu_ps(st + (int64_t)(g + 2 * i) * R16 + c * TQ));
                    __m512i u = split_pair(_mm512_loadu_ps(st + (int64_t)(g + 2 * i + 1) * R16 + c * TQ));
                    his[i] = _mm512_or_si512(_mm512_srli_epi32(a, 16), _mm512_and_si512(u, high));
                    los[i] = _mm512_or_si512(_mm512_and_si512(a, low), _mm512_slli_epi32(u, 16));
                }
                transpose16(his);
                transpose16(los);
                uint32_t *tile = pa + (((int64_t)c * (B32 / (2 * TQ)) + g / (2 * TQ)) * 2) * TQ * TQ;
                for (int i = 0; i < TQ; i++) {
                    _mm512_store_si512(tile + i * TQ, his[i]);
                    _mm512_store_si512(tile + TQ * TQ + i * TQ, los[i]);
                }
            }
        }
        /* 4. the block's partial output [R][D]: tiles 0-3 four 16-dim pieces' sums, 4 and 5 the
           probabilities' hi and lo, 6 the values */
        float *o = out + stat * D;
        const int JD = D / TQ;
        for (int c = 0; c < CT; c++) {
            for (int d0 = 0; d0 < JD; d0 += 4) {
                const int nd = JD - d0 < 4 ? JD - d0 : 4;
                _tile_zero(0);
                _tile_zero(1);
                _tile_zero(2);
                _tile_zero(3);
                for (int g = 0; g < n32; g += 2 * TQ) {
                    const uint32_t *tile = pa + (((int64_t)c * (B32 / (2 * TQ)) + g / (2 * TQ)) * 2) * TQ * TQ;
                    _tile_loadd(4, tile, 64);
                    _tile_loadd(5, tile + TQ * TQ, 64);
                    const uint32_t *v0 = vi + (int64_t)(g / 2) * D + d0 * TQ;
#define PIECE(i)                                            \
    if (nd > i) {                                           \
        _tile_loadd(6, v0 + i * TQ, D * 4);                 \
        _tile_dpbf16ps(i, 4, 6);                            \
        _tile_dpbf16ps(i, 5, 6);                            \
    }
                    PIECE(0) PIECE(1) PIECE(2) PIECE(3)
#undef PIECE
                }
                store_four(ot + d0 * TQ, TQ, D * 4, nd);
            }
            int rows = R - c * TQ < TQ ? R - c * TQ : TQ;
            memcpy(o + (int64_t)c * TQ * D, ot, sizeof(uint32_t) * (size_t)rows * D);
        }
    }
    _tile_release();
    return 0;
}

static ATT_TARGET int blocks_tiles_f16(const void *qt, const void *k, const void *v, int64_t hs, int H, int R,
                                       int D, int64_t T, const int64_t *limit, int block, int64_t j0, int64_t j1,
                                       float *out, float *m, float *l, int chunk, float *cs) {
    return blocks_tiles((const uint32_t *)qt, k, v, hs, H, R, D, T, limit, block, j0, j1, out, m, l, chunk, cs, KV_F16);
}
static ATT_TARGET int blocks_tiles_bf16(const void *qt, const void *k, const void *v, int64_t hs, int H, int R,
                                        int D, int64_t T, const int64_t *limit, int block, int64_t j0, int64_t j1,
                                        float *out, float *m, float *l, int chunk, float *cs) {
    return blocks_tiles((const uint32_t *)qt, k, v, hs, H, R, D, T, limit, block, j0, j1, out, m, l, chunk, cs, KV_BF16);
}
#endif
