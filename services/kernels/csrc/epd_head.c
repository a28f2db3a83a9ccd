/* Greedy tokens from a bfloat16 screen of the LM head (cpu_head.py): the exact argmax of
 * the fp32 logits without computing most of them in fp32.
 *
 * s [m, n] holds bfloat16 logits from oneDNN: x and W rounded to bfloat16 (x^, W^), the
 * products exact, the sums in fp32, the result rounded to bfloat16. For row r and
 * vocabulary entry v the exact logit z = x_r . W_v then lies within
 *     |s - z| <= p[r] * dwn[v] + q[r] * wn[v] + EPS_OUT * |s|
 * since x^.W^ - x.W = x^.(W^ - W) + (x^ - x).W (Cauchy-Schwarz on each): dwn[v] >=
 * ||W^_v - W_v||, wn[v] >= ||W_v||, p[r] >= ||x^_r||, q[r] >= ||x^_r - x_r|| plus the
 * fp32 sums' share; EPS_OUT is the output's rounding. A v whose upper bound is below the
 * row's largest lower bound cannot be its argmax; the rest (a handful on a real head) get
 * exact fp32 dot products here, and the largest wins, the first index on ties, as
 * epd_argmax decides. */
#include "epd_common.h"

#ifndef PREFETCH_ROWS
#define PREFETCH_ROWS 8
#endif
#define EPS_OUT (1.0f / 255.0f) /* bfloat16 rounding of |s| <= 2^-8 |z| <= 2^-8 |s| / (1 - 2^-8) */

static inline float bf16_to_f32(uint16_t h) {
    union { uint32_t u; float f; } v = {.u = (uint32_t)h << 16};
    return v.f;
}

/* The bound's half-width at v for a row's (p, q). */
typedef struct {
    float p, q;
} row_t;

static inline float width1(float sv, const float *wn, const float *dwn, int64_t v, row_t r) {
    return EPS_OUT * fabsf(sv) + r.p * dwn[v] + r.q * wn[v];
}

#if defined(__AVX512F__)
static inline __m512 load_bf16x16(const uint16_t *s) {
    const __m256i h = _mm256_loadu_si256((const __m256i *)s);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
#endif

#if defined(__AVX512F__)
static inline __m512 width16(__m512 sv, const float *wn, const float *dwn, int64_t v, row_t r) {
    const __m512 e = _mm512_mul_ps(_mm512_set1_ps(EPS_OUT), _mm512_abs_ps(sv));
    const __m512 pw = _mm512_mul_ps(_mm512_set1_ps(r.p), _mm512_loadu_ps(dwn + v));
    return _mm512_add_ps(_mm512_add_ps(e, pw), _mm512_mul_ps(_mm512_set1_ps(r.q), _mm512_loadu_ps(wn + v)));
}
#endif

/* The largest lower bound of row s[0, n). */
static float lower_bound(const uint16_t *s, const float *wn, const float *dwn, row_t r,
                         int64_t n) {
    float out = -INFINITY;
    int64_t v = 0;
#if defined(__AVX512F__)
    __m512 best = _mm512_set1_ps(-INFINITY);
    for (; v + 16 <= n; v += 16) {
        const __m512 sv = load_bf16x16(s + v);
        /* a NaN (an infinite logit) can only lower the floor, which keeps more candidates,
         * or make it NaN, which keeps none: the caller's fp32 head then decides */
        best = _mm512_max_ps(best, _mm512_sub_ps(sv, width16(sv, wn, dwn, v, r)));
    }
    out = _mm512_reduce_max_ps(best);
#endif
    for (; v < n; v++) {
        const float sv = bf16_to_f32(s[v]), lo = sv - width1(sv, wn, dwn, v, r);
        out = lo > out ? lo : out;
    }
    return out;
}

/* Indices v whose upper bound reaches `floor`, appended to idx; how many (at most cap),
 * or cap + 1 when there are more. */
static int64_t candidates(int64_t *idx, const uint16_t *s, const float *wn, const float *dwn,
                          row_t r, float floor, int64_t n, int64_t cap) {
    int64_t c = 0, v = 0;
#if defined(__AVX512F__)
    const __m512 fl = _mm512_set1_ps(floor);
    for (; v + 16 <= n; v += 16) {
        const __m512 sv = load_bf16x16(s + v);
        const __m512 hi = _mm512_add_ps(sv, width16(sv, wn, dwn, v, r));
        for (__mmask16 m = _mm512_cmp_ps_mask(hi, fl, _CMP_GE_OQ); m; m &= m - 1) {
            if (c == cap) return cap + 1;
            idx[c++] = v + __builtin_ctz(m);
        }
    }
#endif
    for (; v < n; v++)
        if (bf16_to_f32(s[v]) + width1(bf16_to_f32(s[v]), wn, dwn, v, r) >= floor) {
            if (c == cap) return cap + 1;
            idx[c++] = v;
        }
    return c;
}

/* A candidate: its row and vocabulary entry, and its exact logit once computed. */
typedef struct {
    int64_t row, v;
    float z;
} cand_t;

static int by_entry(const void *a, const void *b) {
    const int64_t x = ((const cand_t *)a)->v, y = ((const cand_t *)b)->v;
    return (x > y) - (x < y);
}

/* x_row . W_v for every candidate: W row-major [n, k] (transposed = 0: one dot product
 * each), or W^T row-major [k, n] (transposed = 1: row by row of W^T, every candidate of
 * every row at once, sorted by v, so each row of W^T is one pass through its pages). */
static void exact_logits(cand_t *c, int64_t nc, const float *x, const float *w, int64_t k,
                         int64_t n, int transposed) {
    if (!transposed) {
        for (int64_t j = 0; j < nc; j++) c[j].z = dot(x + c[j].row * k, w + c[j].v * k, k);
        return;
    }
    qsort(c, (size_t)nc, sizeof *c, by_entry);
    for (int64_t j = 0; j < nc; j++) c[j].z = 0.f;
    for (int64_t i = 0; i < k; i++) {
        const float *wi = w + i * n, *ahead = w + (i + PREFETCH_ROWS < k ? i + PREFETCH_ROWS : i) * n;
        for (int64_t j = 0; j < nc; j++) {
            __builtin_prefetch(ahead + c[j].v);
            c[j].z = fma1(x[c[j].row * k + i], wi[c[j].v], c[j].z);
        }
    }
}

/* out[r] = argmax_v x_r . W_v (fp32) for rows [0, m), the screen as above; -1 for a row
 * with more than cap candidates or none (NaN), which the caller computes in full. Returns
 * how many rows were left that way, or -1 when the scratch could not be allocated. */
int64_t epd_screen_argmax(int64_t *out, const uint16_t *s, const float *x, const float *w,
                          const float *wn, const float *dwn, const float *p, const float *q,
                          int64_t m, int64_t k, int64_t n, int transposed, int64_t cap) {
    int64_t *idx = malloc(sizeof(int64_t) * (size_t)(cap + 1));
    cand_t *c = malloc(sizeof(cand_t) * (size_t)(m * cap + 1));
    int64_t nc = 0, left = 0;
    if (!idx || !c) {
        free(idx);
        free(c);
        return -1;
    }
    for (int64_t r = 0; r < m; r++) {
        const uint16_t *sr = s + r * n;
        const row_t rb = {.p = p[r], .q = q[r]};
        const int64_t got = candidates(idx, sr, wn, dwn, rb, lower_bound(sr, wn, dwn, rb, n), n, cap);
        out[r] = -1;
        if (got > cap || got == 0) {
            left++;
            continue;
        }
        for (int64_t j = 0; j < got; j++) c[nc++] = (cand_t){.row = r, .v = idx[j]};
    }
    exact_logits(c, nc, x, w, k, n, transposed);
    float *best = malloc(sizeof(float) * (size_t)(m > 0 ? m : 1));
    if (!best) {
        free(idx);
        free(c);
        return -1;
    }
    for (int64_t j = 0; j < nc; j++) { /* the largest, the first index on ties */
        const int64_t r = c[j].row;
        if (out[r] < 0 || c[j].z > best[r] || (c[j].z == best[r] && c[j].v < out[r])) {
            best[r] = c[j].z;
            out[r] = c[j].v;
        }
    }
    free(best);
    free(idx);
    free(c);
    return left;
}

static inline uint16_t bf16_bits(float f) { /* the nearest bfloat16, ties to even (finite f) */
    union { float f; uint32_t u; } v = {.f = f};
    return (uint16_t)((v.u + 0x7fffu + ((v.u >> 16) & 1u)) >> 16);
}

/* y[r, :n] += sum over q < runs of xb[r, i + q g] W^T[i + q g, :n], for every row r. */
static void gemv_bf16_pass(float *y, const uint16_t *xb, const uint16_t *wt, int64_t ldw,
                           int64_t m, int64_t k, int64_t n, int64_t i, int runs, int64_t g) {
    for (int64_t r = 0; r < m; r++) {
        float *yr = y + r * n, a[8];
        for (int q = 0; q < runs; q++) a[q] = bf16_to_f32(xb[r * k + i + q * g]);
        int64_t j = 0;
#if defined(__AVX512F__)
        for (; j + 16 <= n; j += 16) {
            __m512 acc = _mm512_loadu_ps(yr + j);
            for (int q = 0; q < runs; q++)
                acc = _mm512_fmadd_ps(_mm512_set1_ps(a[q]),
                                      load_bf16x16(wt + (i + q * g) * ldw + j), acc);
            _mm512_storeu_ps(yr + j, acc);
        }
#endif
        for (; j < n; j++) {
            float acc = yr[j];
            for (int q = 0; q < runs; q++)
                acc = fma1(a[q], bf16_to_f32(wt[(i + q * g) * ldw + j]), acc);
            yr[j] = acc;
        }
    }
}

/* s[r, :n] = bf16(xb[r, :k] . W^T[:k, :n]) for a few rows r, xb = bf16(x) as the caller
 * rounded it for the bound, the sums in fp32: what oneDNN's bfloat16 product gives the
 * screen, from W^T in bfloat16, row-major with row
 * stride ldw (a thread may own a column slice; s has row stride lds). It reads the head
 * as epd_gemv_t reads fp32: eight contiguous runs of k/8 rows side by side, into sums
 * that stay in cache. oneDNN's product of one row streams the packed head at about half
 * that rate. Returns 0, or -1 when the sums' scratch cannot be allocated. */
int epd_gemv_bf16(uint16_t *s, int64_t lds, const uint16_t *xb, const uint16_t *wt,
                  int64_t ldw, int64_t m, int64_t k, int64_t n) {
    float *y = calloc((size_t)(m * n), sizeof(float));
    if (!y) return -1;
    const int64_t g = k / 8;
    for (int64_t i = 0; i < g; i++) gemv_bf16_pass(y, xb, wt, ldw, m, k, n, i, 8, g);
    for (int64_t i = 8 * g; i < k; i++) gemv_bf16_pass(y, xb, wt, ldw, m, k, n, i, 1, g);
    for (int64_t r = 0; r < m; r++)
        for (int64_t j = 0; j < n; j++) s[r * lds + j] = bf16_bits(y[r * n + j]);
    free(y);
    return 0;
}
