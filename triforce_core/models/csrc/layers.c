/* A decoder layer's work around attention, for the few rows of a decoding step or a
 * verification: the norm, the q/k/v projection and the rotary embedding before attention; the
 * output projection, the norm, the SwiGLU MLP and both residual additions after it; and the
 * final norm and vocabulary projection.
 *
 * In PyTorch each of these is a handful of operators on a few hundred floats: a small model's
 * step costs its ~20 operators a layer, not the bytes of weights it reads. Here each part is one
 * call, and the matrix products stream the weights once for all rows on OpenMP threads (in a
 * process that has loaded PyTorch, its own runtime and threads).
 *
 * The arithmetic is PyTorch's, element by element: built without contraction (-ffp-contract=off)
 * so `a * b + c` is two roundings as in PyTorch's separate operators; only the order of the
 * sums inside a norm or a matrix product differs, as it does between PyTorch's own kernels.
 * Weights are either float32 stored [in, out] (`x @ W`, the vocabulary projection [vocab,
 * hidden]), or as a GGUF file stores them (float_products.c): each matrix is passed as its parts.
 * With `int8` (an int8.py mode, the model's `Arithmetic.products`) the K types' parts are
 * integer products over 16-bit activations instead (integer_products.c).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
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

#include "float_products.c"
#include "q_k_blocks.c"
#include "q_k_int16.c"
#include "amx.c"
#include "q_k_tiles.c"
#include "q_k_steps.c"
#include "integer_products.c"

#define COLS 64            /* output columns a job computes (one row: eight vectors in registers) */
#define SMALL_WORK (1 << 16) /* rows x in x out below which one thread runs a product */

/* sum_k a[k] b[k]: eight lanes, then the tail, then the lanes (the same order on every path). */
static inline float dot(const float *a, const float *b, int K) {
    float acc[8] = {0};
    int k = 0;
    for (; k + 8 <= K; k += 8)
        for (int j = 0; j < 8; j++) acc[j] += a[k + j] * b[k + j];
    float sum = 0.0f;
    for (; k < K; k++) sum += a[k] * b[k];
    for (int j = 0; j < 8; j++) sum += acc[j];
    return sum;
}

/* out[s] = (x[s] * 1/sqrt(mean(x[s]^2) + eps)) * w, as transformers' RMSNorm in float32. */
static void rms_norm(const float *x, int S, int E, const float *w, float eps, float *out) {
    for (int s = 0; s < S; s++) {
        const float *xs = x + (int64_t)s * E;
        float r = 1.0f / sqrtf(dot(xs, xs, E) / (float)E + eps);
        float *os = out + (int64_t)s * E;
        for (int e = 0; e < E; e++) os[e] = w[e] * (xs[e] * r);
    }
}

/* Two rows over 32 columns: y[s..s+1][n0 + c] = sum_k x[.][k] w[k][n0 + c], k in order. The
 * rows share each load of the weights: 8 accumulators. */
#ifdef HAVE_AVX2
static void two_rows(const float *x0, const float *x1, int K, const float *w, int64_t ldw, int64_t n0, float *y0, float *y1) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, b0 = a0, b1 = a0, b2 = a0, b3 = a0;
    for (int k = 0; k < K; k++) {
        const float *wk = w + (int64_t)k * ldw + n0;
        __m256 w0 = _mm256_loadu_ps(wk), w1 = _mm256_loadu_ps(wk + 8);
        __m256 w2 = _mm256_loadu_ps(wk + 16), w3 = _mm256_loadu_ps(wk + 24);
        __m256 u = _mm256_set1_ps(x0[k]), v = _mm256_set1_ps(x1[k]);
        a0 = _mm256_fmadd_ps(u, w0, a0), a1 = _mm256_fmadd_ps(u, w1, a1);
        a2 = _mm256_fmadd_ps(u, w2, a2), a3 = _mm256_fmadd_ps(u, w3, a3);
        b0 = _mm256_fmadd_ps(v, w0, b0), b1 = _mm256_fmadd_ps(v, w1, b1);
        b2 = _mm256_fmadd_ps(v, w2, b2), b3 = _mm256_fmadd_ps(v, w3, b3);
    }
    _mm256_storeu_ps(y0 + n0, a0), _mm256_storeu_ps(y0 + n0 + 8, a1), _mm256_storeu_ps(y0 + n0 + 16, a2);
    _mm256_storeu_ps(y0 + n0 + 24, a3);
    _mm256_storeu_ps(y1 + n0, b0), _mm256_storeu_ps(y1 + n0 + 8, b1), _mm256_storeu_ps(y1 + n0 + 16, b2);
    _mm256_storeu_ps(y1 + n0 + 24, b3);
}

/* One row over 64 columns: 256 bytes of each weight row a step (a one-row product streams the
 * weights from memory: the longer runs read them faster than 128 bytes a row). */
static void one_row(const float *x0, int K, const float *w, int64_t ldw, int64_t n0, float *y0) {
    __m256 a[8];
    for (int i = 0; i < 8; i++) a[i] = _mm256_setzero_ps();
    for (int k = 0; k < K; k++) {
        const float *wk = w + (int64_t)k * ldw + n0;
        __m256 u = _mm256_set1_ps(x0[k]);
        for (int i = 0; i < 8; i++) a[i] = _mm256_fmadd_ps(u, _mm256_loadu_ps(wk + 8 * i), a[i]);
    }
    for (int i = 0; i < 8; i++) _mm256_storeu_ps(y0 + n0 + 8 * i, a[i]);
}
#endif

/* y[s][n0 + c] = sum_k x[s][k] w[k][n0 + c] for c < width (width <= COLS), all S rows; every
 * path sums each column over k in order, so a row's result does not depend on its neighbours. */
static void product_block(const float *x, int S, int K, const float *w, int64_t ldw, int64_t N, int64_t n0, int width, float *y) {
    int s = 0;
#ifdef HAVE_AVX2
    if (width == COLS) {
        for (; s + 2 <= S; s += 2)
            for (int half = 0; half < COLS; half += 32)
                two_rows(x + (int64_t)s * K, x + (int64_t)(s + 1) * K, K, w, ldw, n0 + half, y + (int64_t)s * N,
                         y + (int64_t)(s + 1) * N);
        if (s < S) one_row(x + (int64_t)s * K, K, w, ldw, n0, y + (int64_t)s * N);
        return;
    }
#endif
    for (; s < S; s++) {
        float acc[COLS] = {0};
        const float *xs = x + (int64_t)s * K;
        for (int k = 0; k < K; k++) {
            const float *wk = w + (int64_t)k * ldw + n0;
            for (int c = 0; c < width; c++) acc[c] += xs[k] * wk[c];
        }
        memcpy(y + (int64_t)s * N + n0, acc, sizeof(float) * (size_t)width);
    }
}

static int threads_for(int threads, int64_t work) { return work < SMALL_WORK ? 1 : threads; }

static void product(const float *x, int S, int K, const float *w, int64_t ldw, int64_t N, float *y, int threads);

/* y [S, N] = x [S, K] times a matrix: float32 [in, out] (one part), or stacked GGUF parts; with
 * `int8` (a mode), the K types' parts as integer products (integer_products.c). */
static int weights_product(const float *x, int S, int K, const struct part *w, int nparts, int64_t N, float *y, int threads,
                           int int8) {
    if (w[0].type == T_F32_IN_OUT) {
        product(x, S, K, (const float *)w[0].data, w[0].ld, N, y, threads);
        return 0;
    }
    return int8 ? int8_stacked_product(x, S, K, w, nparts, y, threads, int8) : stacked_product(x, S, K, w, nparts, y, threads);
}

/* y [S, N] = x [S, K] @ W^T over a matrix's parts ([N, K] in all; float32 [in, out] too), as the
 * layers compute it: the benchmarks' and tests' way to one product. */
int parts_product(const float *x, int S, int K, const struct part *w, int nparts, float *y, int threads, int int8) {
    int64_t N = 0;
    for (int i = 0; i < nparts; i++) N += w[i].rows;
    return weights_product(x, S, K, w, nparts, N, y, threads, int8);
}

/* y [S, N] = x [S, K] @ w [K, N], the column blocks split over the threads. */
static void product(const float *x, int S, int K, const float *w, int64_t ldw, int64_t N, float *y, int threads) {
    int64_t blocks = (N + COLS - 1) / COLS;
    int nt = threads_for(threads, (int64_t)S * K * N);
#pragma omp parallel for schedule(static) num_threads(nt) if (nt > 1)
    for (int64_t b = 0; b < blocks; b++) {
        int64_t n0 = b * COLS;
        product_block(x, S, K, w, ldw, N, n0, (int)(N - n0 < COLS ? N - n0 : COLS), y);
    }
}

/* The layer before attention. x: [S, E]; w_qkv: [E, (H + 2 Hkv) D]; bias: [(H + 2 Hkv) D] or
 * NULL; qk_norm: [2 D], the weights of an RMSNorm over each query head and each key head before
 * the rotation (Qwen3: q's, then k's), or NULL; cos, sin: [S, rot]: the first rot numbers of each
 * head turn (rot = D, or fewer: partial rotary, Phi-4-mini), the rest pass through as they are.
 * Writes q [H, S, D] and k [Hkv, S, D] (both rotated) and v [Hkv, S, D].
 * Returns non-zero when scratch memory could not be had. */
int layer_in(const float *x, int S, int E, const float *norm_w, float eps, const struct part *w_qkv, int n_qkv, const float *bias,
             const float *qk_norm, int H, int Hkv, int D, const float *cos, const float *sin, float *q, float *k, float *v,
             int threads, int int8, int rot) {
    int64_t N = (int64_t)(H + 2 * Hkv) * D;
    if (rot <= 0 || rot > D) rot = D;
    float *h = malloc(sizeof(float) * ((size_t)S * (size_t)(E + N) + (size_t)D));
    if (!h) return -1;
    float *qkv = h + (int64_t)S * E, *head = qkv + (int64_t)S * N;
    rms_norm(x, S, E, norm_w, eps, h);
    if (weights_product(h, S, E, w_qkv, n_qkv, N, qkv, threads, int8)) {
        free(h);
        return -1;
    }
    int half = rot / 2;
    for (int s = 0; s < S; s++) {
        float *row = qkv + (int64_t)s * N;
        if (bias)
            for (int64_t n = 0; n < N; n++) row[n] = bias[n] + row[n];
        const float *c = cos + (int64_t)s * rot, *sn = sin + (int64_t)s * rot;
        for (int j = 0; j < H + Hkv; j++) {  /* x cos + rotate_half(x) sin, rotate_half(x) = (-x2, x1) */
            const float *src = row + (int64_t)j * D;
            if (qk_norm) {  /* the head normalized on its own, then rotated */
                rms_norm(src, 1, D, qk_norm + (j < H ? 0 : D), eps, head);
                src = head;
            }
            float *dst = j < H ? q + ((int64_t)j * S + s) * D : k + ((int64_t)(j - H) * S + s) * D;
            for (int d = 0; d < half; d++) dst[d] = src[d] * c[d] - src[d + half] * sn[d];
            for (int d = half; d < rot; d++) dst[d] = src[d] * c[d] + src[d - half] * sn[d];
            for (int d = rot; d < D; d++) dst[d] = src[d];
        }
        for (int j = 0; j < Hkv; j++)
            memcpy(v + ((int64_t)j * S + s) * D, row + (int64_t)(H + Hkv + j) * D, sizeof(float) * (size_t)D);
    }
    free(h);
    return 0;
}

/* tanh's GELU, in the order of PyTorch's gelu(approximate="tanh"): x / 2 (1 + tanh(beta (x + kappa x^3))). */
static inline float gelu_tanh(float x) {
    const float beta = 0.7978845608028654f, kappa = 0.044715f;  /* sqrt(2 / pi) */
    float inner = beta * (x + kappa * (x * x * x));
    return 0.5f * x * (1.0f + tanhf(inner));
}

/* The layer after attention, x [S, E] updated in place. attn: [H, S, D], the heads' outputs;
 * w_o: [H D, E]; w_gate_up: [E, 2 I] (gate, then up); w_down: [I, E].
 *   x = x + o @ w_o;  x = x + (silu(g) * u) @ w_down, [g | u] = rms_norm(x) @ w_gate_up
 * post_attn_norm, post_mlp_norm: [E] or NULL, norms of o @ w_o and of the MLP's output before
 * their residuals (Gemma 3's sandwich); gelu: the gate is tanh's GELU (GeGLU), not silu. */
int layer_out(float *x, int S, int E, const float *attn, int H, int D, const struct part *w_o, int n_o,
              const float *norm_w, float eps, const struct part *w_gate_up, int n_gu, const struct part *w_down, int n_down,
              int I, int threads, int int8, const float *post_attn_norm, const float *post_mlp_norm, int gelu) {
    int64_t HD = (int64_t)H * D;
    size_t floats = (size_t)S * (size_t)(HD + E + E + 2 * (int64_t)I + I + E);
    float *o = malloc(sizeof(float) * floats);
    if (!o) return -1;
    float *t = o + (int64_t)S * HD, *h = t + (int64_t)S * E, *gu = h + (int64_t)S * E, *a = gu + (int64_t)S * 2 * I;
    float *tn = a + (int64_t)S * I;  /* a sandwich's normed output */
    for (int hd = 0; hd < H; hd++)
        for (int s = 0; s < S; s++)
            memcpy(o + (int64_t)s * HD + (int64_t)hd * D, attn + ((int64_t)hd * S + s) * D, sizeof(float) * (size_t)D);
    if (weights_product(o, S, (int)HD, w_o, n_o, E, t, threads, int8)) goto failed;
    const float *r = t;
    if (post_attn_norm) {
        rms_norm(t, S, E, post_attn_norm, eps, tn);
        r = tn;
    }
    for (int64_t i = 0; i < (int64_t)S * E; i++) x[i] = x[i] + r[i];
    rms_norm(x, S, E, norm_w, eps, h);
    if (weights_product(h, S, E, w_gate_up, n_gu, 2 * (int64_t)I, gu, threads, int8)) goto failed;
    for (int s = 0; s < S; s++) {
        const float *g = gu + (int64_t)s * 2 * I, *u = g + I;
        float *as = a + (int64_t)s * I;
        if (gelu)
            for (int i = 0; i < I; i++) as[i] = gelu_tanh(g[i]) * u[i];
        else
            for (int i = 0; i < I; i++) as[i] = (g[i] / (1.0f + expf(-g[i]))) * u[i];
    }
    if (weights_product(a, S, I, w_down, n_down, E, t, threads, int8)) goto failed;
    r = t;
    if (post_mlp_norm) {
        rms_norm(t, S, E, post_mlp_norm, eps, tn);
        r = tn;
    }
    for (int64_t i = 0; i < (int64_t)S * E; i++) x[i] = x[i] + r[i];
    free(o);
    return 0;
failed:
    free(o);
    return -1;
}

/* logits [R, V] = rms_norm(x) @ lm_head^T, x: [R, E], lm_head: [V, E] float32 rows or GGUF parts. */
int final_logits(const float *x, int R, int E, const float *norm_w, float eps, const struct part *head, int n_head, int64_t V,
                 float *logits, int threads, int int8) {
    float *h = malloc(sizeof(float) * (size_t)R * (size_t)E);
    if (!h) return -1;
    rms_norm(x, R, E, norm_w, eps, h);
    if (head[0].type != T_F32) {
        int failed = int8 ? int8_stacked_product(h, R, E, head, n_head, logits, threads, int8)
                          : stacked_product(h, R, E, head, n_head, logits, threads);
        free(h);
        return failed;
    }
    const float *lm_head = (const float *)head[0].data;
    int nt = threads_for(threads, (int64_t)R * E * V);
#pragma omp parallel for schedule(static) num_threads(nt) if (nt > 1)
    for (int64_t n = 0; n < V; n++) {
        const float *wn = lm_head + n * E;
        for (int r = 0; r < R; r++) logits[(int64_t)r * V + n] = dot(h + (int64_t)r * E, wn, E);
    }
    free(h);
    return 0;
}

/* ---- A whole forward of few rows: every layer in one call ----------------------------------
 *
 * A decoding step spent a share of its time in Python between the native calls of each layer
 * (three calls, the cache's views and copies, a dozen small tensors). Here
 * one call runs every layer: the same layer_in, the new keys and values written into the cache
 * (rounded into its dtype as PyTorch's copy rounds: to nearest even), the same few-row
 * attention (the attention library's own function, passed by address), the same layer_out. So
 * its logits equal, bit for bit, those of the per-layer path it replaces (tested). */

struct layer_weights {
    const float *attn_norm;
    const struct part *w_qkv;
    int n_qkv;
    const float *bias; /* [(H + 2 Hkv) D] or NULL */
    const struct part *w_o;
    int n_o;
    const float *mlp_norm;
    const struct part *w_gate_up;
    int n_gu;
    const struct part *w_down;
    int n_down;
    const float *qk_norm; /* [2 D] or NULL: layer_in's */
};

/* attention.c's `attention`. */
typedef int (*attention_fn)(const float *q, const void *k, const void *v, int64_t head_stride, int kind, int H, int R,
                            int D, int64_t T, const int64_t *limit, int block, int threads, float *out, float *m_out,
                            float *l_out, int chunk, float *chunk_sum, float *result);

enum { CACHE_F32 = 0, CACHE_F16 = 1, CACHE_BF16 = 2, CACHE_I16 = 3 };

/* An int16 cache (csrc/integer_attention.c's layout): the planes k, v of every layer and head and
 * their steps sk, sv, with the library's own writer and integer attention (`path`: its number). */
typedef int (*integer_write_fn)(const float *k, const float *v, int H, int64_t n, int D, int64_t start, uint8_t *kp,
                                uint8_t *vp, float *sk, float *sv, int64_t head_bytes, int64_t scale_stride);
typedef int (*integer_attention_fn)(const float *q, const uint8_t *k, const uint8_t *v, const float *sk,
                                    const float *sv, int64_t head_bytes, int64_t scale_stride, int H, int R, int D,
                                    int64_t T, const int64_t *limit, int block, int threads, int path, float *out,
                                    float *m_out, float *l_out, int chunk, float *chunk_sum, float *result);
struct int16_cache {
    uint8_t *k, *v;
    float *sk, *sv;
    int64_t layer_bytes, head_bytes, layer_steps, head_steps;
    integer_write_fn write;
    integer_attention_fn attend;
    int path;
};

/* n floats into the cache's dtype, rounded to nearest even as PyTorch's copy_ rounds. */
static void to_cache(const float *src, void *dst, int64_t n, int kind) {
    if (kind == CACHE_F32) {
        memcpy(dst, src, sizeof(float) * (size_t)n);
        return;
    }
    uint16_t *out = dst;
    for (int64_t i = 0; i < n; i++) {
        if (kind == CACHE_F16) {
#ifdef __F16C__
            out[i] = _cvtss_sh(src[i], 0); /* 0: round to nearest even */
#endif
        } else {
            uint32_t u;
            memcpy(&u, &src[i], 4);
            out[i] = (u & 0x7fffffffu) > 0x7f800000u ? 0x7fc0 : (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
        }
    }
}

/* Whether decode_layers can write a cache of this kind (float16 needs F16C's conversion; int16
 * brings its own writer). */
int decode_layers_takes(int kind) {
#ifdef __F16C__
    return kind == CACHE_F32 || kind == CACHE_F16 || kind == CACHE_BF16 || kind == CACHE_I16;
#else
    return kind == CACHE_F32 || kind == CACHE_BF16 || kind == CACHE_I16;
#endif
}

/* x [S, E] through L layers, in place. k_cache/v_cache (`kind`): [L, Hkv, capacity, D] with
 * `length` tokens cached; the S new ones are written after them. Rows attend causally to
 * every cached key (no window). scale: q's factor before attention; block, attn_threads:
 * the attention's blocks of keys and threads (as native_attention.Kernel picks them).
 * queries (or NULL): [L, S, H, D], each layer's rotated queries before scaling. chunk > 0:
 * chunk_sum [L, Hkv, R, T / chunk] gets each layer's attention probability per whole chunk of
 * keys (the attention's own `chunk_sum`). An int16 cache (kind CACHE_I16) is `planes`, which
 * writes and attends with its own functions (k_cache, v_cache and the strides are then unused).
 * cos, sin: [S, rot], layer_in's (rot: the numbers of each head the rotary embedding turns).
 * Returns non-zero when scratch memory could not be had or a call failed (-2: a cache dtype this
 * build cannot write). */
int decode_layers(float *x, int S, int E, const struct layer_weights *layers, int L, float eps, int H, int Hkv, int D,
                  int I, const float *cos, const float *sin, float scale, void *k_cache, void *v_cache, int kind,
                  int64_t layer_stride, int64_t head_stride, int64_t length, attention_fn attention, int block,
                  float *queries, int chunk, float *chunk_sum, int attn_threads, int threads, int int8,
                  const struct int16_cache *planes, int rot) {
    if (!decode_layers_takes(kind) || (kind == CACHE_I16 && !planes)) return -2;
    int64_t T = length + S, nb = (T + block - 1) / block;
    int R = (H / Hkv) * S, es = kind == CACHE_F32 ? 4 : 2;
    size_t floats = (size_t)H * S * D + 2 * (size_t)Hkv * S * D + (size_t)Hkv * nb * R * (D + 2) + (size_t)Hkv * R * D;
    float *q = malloc(sizeof(float) * floats);
    int64_t *limits = S > 1 ? malloc(sizeof(int64_t) * (size_t)R) : NULL;
    if (!q || (S > 1 && !limits)) {
        free(q);
        free(limits);
        return -1;
    }
    float *k = q + (int64_t)H * S * D, *v = k + (int64_t)Hkv * S * D, *out = v + (int64_t)Hkv * S * D;
    float *m = out + (int64_t)Hkv * nb * R * D, *l = m + (int64_t)Hkv * nb * R, *result = l + (int64_t)Hkv * nb * R;
    /* rows ordered (g, s): row s of every query head sees the cached keys and the new ones up to its own */
    for (int r = 0; r < R && limits; r++) limits[r] = length + 1 + r % S;
    int failed = 0;
    for (int i = 0; i < L && !failed; i++) {
        const struct layer_weights *w = &layers[i];
        /* 1. norm, q/k/v, rotary: q [H, S, D], k, v [Hkv, S, D] */
        failed = layer_in(x, S, E, w->attn_norm, eps, w->w_qkv, w->n_qkv, w->bias, w->qk_norm, H, Hkv, D, cos, sin, q, k, v, threads, int8, rot);
        if (failed) break;
        /* 2. the new keys and values into the cache, after the `length` cached ones */
        char *kl = NULL, *vl = NULL;
        if (kind != CACHE_I16) kl = (char *)k_cache + i * layer_stride * es, vl = (char *)v_cache + i * layer_stride * es;
        uint8_t *kp = NULL, *vp = NULL;
        float *sk = NULL, *sv = NULL;
        if (kind == CACHE_I16) {
            kp = planes->k + i * planes->layer_bytes, vp = planes->v + i * planes->layer_bytes;
            sk = planes->sk + i * planes->layer_steps, sv = planes->sv + i * planes->layer_steps;
            failed = planes->write(k, v, Hkv, S, D, length, kp, vp, sk, sv, planes->head_bytes, planes->head_steps);
            if (failed) break;
        }
        for (int h = 0; h < Hkv && kind != CACHE_I16; h++) {
            to_cache(k + (int64_t)h * S * D, kl + (h * head_stride + length * D) * es, (int64_t)S * D, kind);
            to_cache(v + (int64_t)h * S * D, vl + (h * head_stride + length * D) * es, (int64_t)S * D, kind);
        }
        /* 3. attention: the G query heads sharing a KV head are its R = G S rows */
        if (queries)
            for (int h = 0; h < H; h++)
                for (int s = 0; s < S; s++)
                    memcpy(queries + (((int64_t)i * S + s) * H + h) * D, q + ((int64_t)h * S + s) * D, sizeof(float) * (size_t)D);
        for (int64_t j = 0; j < (int64_t)H * S * D; j++) q[j] = q[j] * scale;
        float *cs = chunk > 0 ? chunk_sum + (int64_t)i * Hkv * R * (T / chunk) : NULL;
        if (kind == CACHE_I16)
            failed = planes->attend(q, kp, vp, sk, sv, planes->head_bytes, planes->head_steps, Hkv, R, D, T, limits,
                                    block, attn_threads, planes->path, out, m, l, chunk > 0 ? chunk : 0, cs, result);
        else
            failed = attention(q, kl, vl, head_stride, kind, Hkv, R, D, T, limits, block, attn_threads, out, m, l,
                               chunk > 0 ? chunk : 0, cs, result);
        if (failed) break;
        /* 4. output projection, MLP, residuals: result [Hkv, R, D] is [H, S, D] */
        failed = layer_out(x, S, E, result, H, D, w->w_o, w->n_o, w->mlp_norm, eps, w->w_gate_up, w->n_gu, w->w_down,
                           w->n_down, I, threads, int8, NULL, NULL, 0);
    }
    free(q);
    free(limits);
    return failed;
}
