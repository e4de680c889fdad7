/* Integer products chosen and run: which parts take which kernel (q_k_int16.c's 16-bit
 * activations for the K types; q_k_tiles.c's on AMX's tiles, q_k_steps.c's in the steps' order), the
 * activation rows quantized for them, and the outputs split over the threads. A mode is
 * int8.py's: INT8_WIDE (16-bit activations for the K types), INT8_TILES (WIDE's with those parts
 * on AMX's tiles, for a prefill's rows), INT8_STEP_TILES (the same activations, the K types in
 * the steps' order of q_k_steps.c: VNNI up to 3 rows, the tiles above). The 32-weight types and
 * float parts keep the float path in every mode.
 *
 * Included by layers.c after q_k_steps.c.
 */

/* y [S, N] = x [S, K] @ W^T over the stacked parts: the 256-weight types' parts from xw (S x K/256
 * block_q16_k, or `ta`'s layouts), the others (32-weight types, F32, F16) by the float path from
 * x. With `quantize_xw`, x's rows are first quantized into xw by the same threads (a row is one
 * thread's: the same bits). Jobs of OUT_JOB outputs over the threads, as stacked_product.
 * Returns -1 without scratch memory, -2 where an input a part needs is missing (or a part is
 * not a GGUF tensor's). */
static int product_q(const float *x, void *xw, int S, int K, const struct part *parts, int nparts, float *y, int threads,
                     int quantize_xw, const struct tile_acts *ta) {
    int64_t N = 0;
    for (int i = 0; i < nparts; i++) {
        int t = parts[i].type;
        if (!is_block_type(t) && t != T_F32 && t != T_F16) return -2;  /* GGUF parts only */
        if (is_k_type(t) ? !xw : !x) return -2;
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
        if (quantize_xw) {  /* a prefill's many rows: quantized by every thread, not one */
#pragma omp for schedule(static)
            for (int s = 0; s < S; s++)
                quantize_q16_k(x + (int64_t)s * K, K, (struct block_q16_k *)xw + (int64_t)s * (K / 256));
        }
        /* 16-bit rows a group of I16_ROWS at a time over every output: a group's activations stay in the second level of cache
         * while the weights stream past them, where all of a prefill's rows for every job
         * (1.2 MB for 256 rows of 2,048 inputs) came from the third. */
        int group = ta ? (ta->steps ? tile_group(K) / STEP_ROWS * STEP_ROWS : tile_group(K)) : I16_ROWS;
        for (int s0 = 0; s0 < S; s0 += group) {
            int g = S - s0 < group ? S - s0 : group;
            /* guided: a thread that finishes early takes jobs from the other's share; each
             * output is still one thread's, so the bits do not change */
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
                            q_k_steps_vnni(&parts[i], r, r + 16 < hi ? r + 16 : hi, (const struct block_q16_k *)xw + (int64_t)s0 * (K / 256),
                                              K, y + (int64_t)s0 * N + base, N, g);
                        continue;
                    }
#endif
                    if (ta && is_k_type(parts[i].type) && (!ta->steps || step_type(parts[i].type)))
                        tile_outputs(&parts[i], lo, hi, ta, s0, g, K, y + (int64_t)s0 * N + base, N, path);
                    else if (is_k_type(parts[i].type))
                        q_k_int16_outputs(&parts[i], lo, hi, (const struct block_q16_k *)xw + (int64_t)s0 * (K / 256), g, K, y + (int64_t)s0 * N + base, N, path);
                    else if (w)
                        stacked_outputs(x + (int64_t)s0 * K, g, K, &parts[i], 1, lo, hi, y + (int64_t)s0 * N + base, N, w);
                }
            }
        }
        free(w);
    }
    return failed ? -1 : 0;
}

/* stacked_product with the 256-weight types' parts as integer products over 16-bit activations
 * (x's rows quantized once, q_k_int16.c), the others by the float path; with `ta` (no layouts:
 * the steps' order for rows VNNI takes alone) as product_q's. */
static int wide_stacked_product(const float *x, int S, int K, const struct part *parts, int nparts, float *y, int threads,
                                const struct tile_acts *ta) {
    int needk = 0;
    for (int i = 0; i < nparts; i++) needk |= is_k_type(parts[i].type);
    if (!needk || K % 256) return stacked_product(x, S, K, parts, nparts, y, threads);
    struct block_q16_k *xw = malloc(sizeof(*xw) * (size_t)S * (size_t)(K / 256));
    if (!xw) return -1;
    int failed = product_q(x, xw, S, K, parts, nparts, y, threads, 1, ta);
    free(xw);
    return failed;
}

/* wide_stacked_product for a prefill's rows: the 256-weight types' parts on tiles (q_k_tiles.c:
 * the same 16-bit activations, their own order), the others by the float path as there. */
static int tiles_stacked_product(const float *x, int S, int K, const struct part *parts, int nparts, float *y, int threads,
                                 int steps) {
    int needk = 0;
    for (int i = 0; i < nparts; i++) needk |= is_k_type(parts[i].type);
    if (!needk || K % 256) return wide_stacked_product(x, S, K, parts, nparts, y, threads, NULL);
    int nb = K / 256, S_pad = (S + TILE_M - 1) / TILE_M * TILE_M;
    tiles_ready();  /* asked once here, not first by two threads at once */
    if (steps && S <= VNNI_STEP_ROWS && int8_path() == INT8_AVX512_VNNI && tiles_ready()) {
        /* a step: VNNI in the tiles' order (q_k_steps_vnni) reads the rows as WIDE does,
           so none of the tiles' layouts is made (their allocations would cost a step) */
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
        failed = steps && step_acts(&a, S, K) ? -1 : product_q(x, xw, S, K, parts, nparts, y, threads, 0, &a);
    }
    free(xw);
    tile_acts_free(&a);
    return failed;
}

/* stacked_product with the 256-weight types' parts as integer products in `mode` (INT8_WIDE,
 * INT8_TILES, INT8_STEP_TILES), the others by the float path. Returns -2 for another mode. */
static int int8_stacked_product(const float *x, int S, int K, const struct part *parts, int nparts, float *y, int threads,
                                int mode) {
    if (mode == INT8_WIDE) return wide_stacked_product(x, S, K, parts, nparts, y, threads, NULL);
    if (mode == INT8_TILES || mode == INT8_STEP_TILES)
        return tiles_stacked_product(x, S, K, parts, nparts, y, threads, mode == INT8_STEP_TILES);
    return -2;
}
