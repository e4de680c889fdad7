/* Integer products chosen and run: which parts take which kernel (int8_rows.c's 8-bit
 * activations, one level or two; int16_rows.c's 16-bit ones; tile_rows.c's for a prefill), the activation rows quantized
 * for them, and the outputs split over the threads. A mode is int8.py's: INT8_ONE_LEVEL,
 * INT8_TWO_LEVELS, INT8_FAST (two levels for the 256-weight types), INT8_WIDE (16-bit
 * activations for the 256-weight types), INT8_TILES (WIDE with those parts on AMX tiles, for
 * a prefill's rows), INT8_STEP_TILES (the same activations, the K types in the steps' order of
 * tile_rows.c: VNNI up to 3 rows, the tiles above); in FAST, WIDE and the tiles the 32-weight types keep the float
 * path, where the integer products cost more than it (`python -m bench.int8_rows`).
 *
 * Included by layers.c after tile_rows.c.
 */

/* Whether a part of `type` takes the integer products: every int8 type, or with `k_only` the
 * 256-weight ones (the 32-weight types then keep the float path). */
static inline int integer_part(int type, int k_only) { return k_only ? is_k_type(type) : is_int8_type(type); }

/* int8_product_q, with `k_only` as integer_part's, and the 256-weight types' parts from xw
 * (S x K/256 block_q16_k) where it is given, else from xk. With `quantize_xw`, x's rows are
 * first quantized into xw by the same threads (a row is one thread's: the same bits). */
static int product_q(const float *x, const void *x32, const void *xk, void *xw, int S, int K, const struct part *parts,
                     int nparts, float *y, int threads, int k_only, int quantize_xw, const struct tile_acts *ta) {
    int64_t N = 0;
    for (int i = 0; i < nparts; i++) {
        int t = parts[i].type, integer = integer_part(t, k_only);
        if (!is_int8_type(t) && t != T_F32 && t != T_F16) return -2;  /* GGUF parts only */
        if (!integer ? !x : is_k_type(t) ? !xk && !xw : !x32) return -2;
        if (K <= 0 || K % block_weights(t)) return -2;
        N += parts[i].rows;
    }
    int path = int8_path();
    int64_t jobs = (N + OUT_JOB - 1) / OUT_JOB;
    int nt = (int64_t)S * K * N < (1 << 16) ? 1 : threads, failed = 0;
#pragma omp parallel num_threads(nt) if (nt > 1)
    {
        float *w = x ? malloc(sizeof(float) * (size_t)K) : NULL;
        if (x && !w) {
#pragma omp atomic write
            failed = 1;
        }
        if (quantize_xw) {  /* a prefill's 1,024 rows took 3 % of its time on one thread */
#pragma omp for schedule(static)
            for (int s = 0; s < S; s++)
                quantize_q16_k(x + (int64_t)s * K, K, (struct block_q16_k *)xw + (int64_t)s * (K / 256));
        }
        /* 16-bit rows a group of I16_ROWS at a time over every output (the others take all S
         * rows at once, as before): a group's activations stay in the second level of cache
         * while the weights stream past them, where all of a prefill's rows for every job
         * (1.2 MB for 256 rows of 2,048 inputs) came from the third. */
        int group = ta ? (ta->steps ? tile_group(K) / STEP_ROWS * STEP_ROWS : tile_group(K)) : xw ? I16_ROWS : S;
        for (int s0 = 0; s0 < S; s0 += group) {
            int g = S - s0 < group ? S - s0 : group;
            /* guided: a thread that finishes early takes jobs from the other's share (one step
             * of the 1B shape at 4K 35.6 against 36.0 ms, 3B 90.6 against 91.5, 7 rows 138 against
             * 141); each output is still one thread's, so the bits do not change */
            /* nowait: the groups write different rows of y, so a thread that finishes one
             * group's share goes on to the next instead of waiting at a barrier for each */
#pragma omp for schedule(guided) nowait
            for (int64_t j = 0; j < jobs; j++) {
                int64_t o0 = j * OUT_JOB, o1 = (j + 1) * OUT_JOB < N ? (j + 1) * OUT_JOB : N, base = 0;
                for (int i = 0; i < nparts && base < o1; base += parts[i].rows, i++) {
                    int64_t lo = o0 > base ? o0 - base : 0, hi = o1 - base < parts[i].rows ? o1 - base : parts[i].rows;
                    if (lo >= hi) continue;
#ifdef TILES_X86
                    if (ta && ta->steps && g <= VNNI_STEP_ROWS && step_type(parts[i].type) && path == INT8_AVX512_VNNI && tiles_ready()) {
                        for (int64_t r = lo; r < hi; r += 16)  /* a few rows: VNNI in the tiles' order */
                            vnni_step_outputs(&parts[i], r, r + 16 < hi ? r + 16 : hi, (const struct block_q16_k *)xw + (int64_t)s0 * (K / 256),
                                              K, y + (int64_t)s0 * N + base, N, g);
                        continue;
                    }
#endif
                    if (ta && is_k_type(parts[i].type) && (!ta->steps || step_type(parts[i].type)))
                        tile_outputs(&parts[i], lo, hi, ta, s0, g, K, y + (int64_t)s0 * N + base, N, path);
                    else if (xw && is_k_type(parts[i].type))
                        int16_outputs(&parts[i], lo, hi, (const struct block_q16_k *)xw + (int64_t)s0 * (K / 256), g, K, y + (int64_t)s0 * N + base, N, path);
                    else if (integer_part(parts[i].type, k_only))
                        int8_outputs(&parts[i], lo, hi, x32, xk, S, K, y + base, N, path);
                    else if (w)
                        stacked_outputs(x + (int64_t)s0 * K, g, K, &parts[i], 1, lo, hi, y + (int64_t)s0 * N + base, N, w);
                }
            }
        }
        free(w);
    }
    return failed ? -1 : 0;
}

/* y [S, N] = x [S, K] @ W^T over the stacked parts, the int8 types' parts from the quantized
 * rows (x32: S x ceil(K/256) block_q8_32x8, xk: S x K/256 block_q8_k; each may be NULL where no part
 * needs it), the others (F32, F16) by the float path from x (NULL where there are none). Jobs
 * of OUT_JOB outputs over the threads, as stacked_product. Returns -1 without scratch memory,
 * -2 where an input a part needs is missing (or a part is not a GGUF tensor's). */
int int8_product_q(const float *x, const void *x32, const void *xk, int S, int K, const struct part *parts, int nparts,
                   float *y, int threads) {
    return product_q(x, x32, xk, NULL, S, K, parts, nparts, y, threads, 0, 0, NULL);
}

/* The residual of rows quantized in `kind`'s layout: r = x - d q, per element, each row on its own. */
static void q8_residual(const float *x, int S, int K, int kind, const void *q, float *r) {
    for (int s = 0; s < S; s++) {
        const float *xs = x + (int64_t)s * K;
        float *rs = r + (int64_t)s * K;
        for (int e = 0; e < K; e++) {
            float d;
            int8_t v;
            if (kind == Q8_K) {
                const struct block_q8_k *b = (const struct block_q8_k *)q + (int64_t)s * (K / 256) + e / 256;
                d = b->d, v = b->qs[e % 256];
            } else {
                const struct block_q8_32x8 *g = (const struct block_q8_32x8 *)q + (int64_t)s * act_blocks(K, Q8_32) + e / 256;
                d = g->d[(e % 256) / 32], v = g->qs[e % 256];
            }
            rs[e] = xs[e] - d * (float)v;
        }
    }
}

/* x's S rows as 2S quantized rows in `kind`'s layout, interleaved: row 2s the row quantized, row
 * 2s + 1 what that left (its residual, quantized with its own scales). Together they carry about
 * 15 bits of each input: the residual is at most half a step of the first, and is itself cut to
 * 1/254 of that. */
static int quantize_two_levels(const float *x, int S, int K, int kind, void *out) {
    size_t row_bytes = (kind == Q8_K ? sizeof(struct block_q8_k) : sizeof(struct block_q8_32x8)) * (size_t)act_blocks(K, kind);
    float *r = malloc(sizeof(float) * (size_t)K);
    if (!r) return -1;
    for (int s = 0; s < S; s++) {  /* each row straight into its slot, its residual into the next */
        const float *xs = x + (int64_t)s * K;
        uint8_t *first = (uint8_t *)out + row_bytes * (size_t)(2 * s);
        int8_quantize_rows(xs, 1, K, kind, first);
        q8_residual(xs, 1, K, kind, first, r);
        int8_quantize_rows(r, 1, K, kind, first + row_bytes);
    }
    free(r);
    return 0;
}

/* stacked_product with the 256-weight types' parts as integer products over 16-bit activations
 * (x's rows quantized once, int16_rows.c), the others by the float path; with `ta` (no layouts:
 * the steps' order for rows VNNI takes alone) as product_q's. */
static int wide_stacked_product(const float *x, int S, int K, const struct part *parts, int nparts, float *y, int threads,
                                const struct tile_acts *ta) {
    int needk = 0;
    for (int i = 0; i < nparts; i++) needk |= is_k_type(parts[i].type);
    if (!needk || K % 256) return stacked_product(x, S, K, parts, nparts, y, threads);
    struct block_q16_k *xw = malloc(sizeof(*xw) * (size_t)S * (size_t)(K / 256));
    if (!xw) return -1;
    int failed = product_q(x, NULL, NULL, xw, S, K, parts, nparts, y, threads, 1, 1, ta);
    free(xw);
    return failed;
}

/* wide_stacked_product for a prefill's rows: the 256-weight types' parts on tiles (tile_rows.c:
 * the same 16-bit activations, their own order), the others by the float path as there. */
static int tiles_stacked_product(const float *x, int S, int K, const struct part *parts, int nparts, float *y, int threads,
                                 int steps) {
    int needk = 0;
    for (int i = 0; i < nparts; i++) needk |= is_k_type(parts[i].type);
    if (!needk || K % 256) return wide_stacked_product(x, S, K, parts, nparts, y, threads, NULL);
    int nb = K / 256, S_pad = (S + TILE_M - 1) / TILE_M * TILE_M;
    tiles_ready();  /* asked once here, not first by two threads at once */
    if (steps && S <= VNNI_STEP_ROWS && int8_path() == INT8_AVX512_VNNI && tiles_ready()) {
        /* a step: VNNI in the tiles' order (vnni_step_outputs) reads the rows as WIDE does,
           so none of the tiles' layouts is made (they cost a step 4 % in allocations) */
        const struct tile_acts none = {NULL, NULL, NULL, NULL, S_pad, steps, NULL, NULL};
        return wide_stacked_product(x, S, K, parts, nparts, y, threads, &none);
    }
    struct block_q16_k *xw = malloc(sizeof(*xw) * (size_t)S * (size_t)nb);
    struct tile_acts a = {calloc((size_t)S_pad * (size_t)K, 1), calloc((size_t)S_pad * (size_t)K, 1),
                          calloc((size_t)S_pad * (size_t)nb * 8, sizeof(int32_t)), calloc((size_t)S_pad * (size_t)nb, sizeof(float)),
                          S_pad, steps, NULL, NULL};
    int failed = -1;
    if (xw && a.hi && a.lo && a.bsums && a.d) {
        int nt = (int64_t)S * K < (1 << 14) ? 1 : threads;
#pragma omp parallel for num_threads(nt) if (nt > 1) schedule(static)
        for (int s = 0; s < S; s++) {  /* each row on its own: the same bits whatever the threads */
            quantize_q16_k(x + (int64_t)s * K, K, xw + (int64_t)s * nb);
            tile_acts_row(xw, K, s, &a);
        }
        failed = steps && step_acts(&a, S, K) ? -1 : product_q(x, NULL, NULL, xw, S, K, parts, nparts, y, threads, 1, 0, &a);
    }
    free(xw);
    tile_acts_free(&a);
    return failed;
}

/* stacked_product with the int8 types' parts as integer products: x's rows quantized first,
 * to the layouts the parts need. `mode`: INT8_ONE_LEVEL, INT8_TWO_LEVELS, or INT8_FAST (two
 * levels for the 256-weight types, the float path for the 32-weight ones, where two levels'
 * doubled integer work costs more than the float products: bench.int8_rows). With two levels
 * each row is quantized twice (the row, then its residual: `quantize_two_levels`), both
 * multiplied, and an output is the first product plus the second, in that order: one rounding more per output, the same for every row count. A
 * part of float weights (F32, F16) sees the row and then a row of zeros, so its output is the
 * float path's exactly. */
static int int8_stacked_product(const float *x, int S, int K, const struct part *parts, int nparts, float *y, int threads,
                                int mode) {
    if (mode == INT8_WIDE) return wide_stacked_product(x, S, K, parts, nparts, y, threads, NULL);
    if (mode == INT8_TILES || mode == INT8_STEP_TILES)
        return tiles_stacked_product(x, S, K, parts, nparts, y, threads, mode == INT8_STEP_TILES);
    int k_only = mode == INT8_FAST, levels = mode == INT8_ONE_LEVEL ? 1 : 2;
    int need32 = 0, needk = 0, floats = 0;
    for (int i = 0; i < nparts; i++) {
        need32 |= integer_part(parts[i].type, k_only) && !is_k_type(parts[i].type);
        needk |= is_k_type(parts[i].type);
        floats |= !integer_part(parts[i].type, k_only);
    }
    if (!need32 && !needk) return stacked_product(x, S, K, parts, nparts, y, threads);
    int R = levels == 2 ? 2 * S : S;
    int64_t N = 0;
    for (int i = 0; i < nparts; i++) N += parts[i].rows;
    struct block_q8_32x8 *x32 = need32 ? malloc(sizeof(*x32) * (size_t)R * (size_t)act_blocks(K, Q8_32)) : NULL;
    struct block_q8_k *xk = needk ? malloc(sizeof(*xk) * (size_t)R * (size_t)(K / 256)) : NULL;
    float *xr = levels == 2 && floats ? calloc((size_t)R * (size_t)K, sizeof(float)) : NULL;
    float *yr = levels == 2 ? malloc(sizeof(float) * (size_t)R * (size_t)N) : NULL;
    int failed = -1;
    if ((!need32 || x32) && (!needk || xk) && (levels != 2 || (yr && (!floats || xr)))) {
        failed = 0;
        if (levels == 2) {
            if (need32) failed |= quantize_two_levels(x, S, K, Q8_32, x32);
            if (needk) failed |= quantize_two_levels(x, S, K, Q8_K, xk);
            if (xr)
                for (int s = 0; s < S; s++) memcpy(xr + (int64_t)(2 * s) * K, x + (int64_t)s * K, sizeof(float) * (size_t)K);
            if (!failed) failed = product_q(xr, x32, xk, NULL, R, K, parts, nparts, yr, threads, k_only, 0, NULL);
            if (!failed)
                for (int s = 0; s < S; s++)
                    for (int64_t n = 0; n < N; n++)
                        y[(int64_t)s * N + n] = yr[(int64_t)(2 * s) * N + n] + yr[(int64_t)(2 * s + 1) * N + n];
        } else {
            if (need32) int8_quantize_rows(x, S, K, Q8_32, x32);
            if (needk) int8_quantize_rows(x, S, K, Q8_K, xk);
            failed = int8_product_q(x, x32, xk, S, K, parts, nparts, y, threads);
        }
    }
    free(x32);
    free(xk);
    free(xr);
    free(yr);
    return failed;
}
