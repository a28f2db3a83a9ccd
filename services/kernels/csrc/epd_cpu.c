/* Native CPU kernels of the "cpu" backend (services/kernels/cpu_backend.py).
 *
 * Plain C, fp32 only, one thread per call (the Python side splits work across threads;
 * ctypes releases the GIL). Built on first use with the system C compiler and
 * -O3 -march=native; loops are written so the compiler vectorizes them without
 * -ffast-math: reductions keep VW independent partial sums, so results are
 * deterministic for a given build. Contracts are those of the torch reference ops in
 * services/kernels/torch_backend.py.
 */
#include "epd_common.h"

/* y[r, :n] = x[r, :k] @ wt[:k, :n] (+ bias) for a few rows r, wt = W^T stored row-major
 * with row stride ldw, y with row stride ldy (a thread may own a column slice of both).
 * Streams wt once into y rows that stay in cache: batch-1 decode is bound by this read.
 * The k rows are cut into eight contiguous runs read side by side, one row of each per
 * pass: eight long sequential streams. (Eight adjacent rows per pass were eight streams of
 * one row each, too short for the hardware prefetcher on a layer's small matrices: ~17
 * against ~24 GB/s here; four or sixteen streams do worse.) More rows go to
 * epd_gemv_rows (epd_gemv_rows.c): the same sums in the same order, each weight vector
 * loaded once for all rows. The loop below serves one row; two rows too when a pass's
 * eight weight rows stay in L2 (n <= GEMV_L2_COLS: a layer's matrices, 0-9 % faster
 * than epd_gemv_rows in six runs here; an LM head's re-read from L3 is not); and any
 * rows when epd_gemv_rows cannot allocate its scratch. */
#define GEMV_L2_COLS 8192 /* eight rows of 8192 floats: 256 KB, half of L2 */
void epd_gemv_t(float *y, int64_t ldy, const float *x, const float *wt, int64_t ldw,
                const float *bias, int64_t m, int64_t k, int64_t n) {
    if ((m > 2 || (m == 2 && n > GEMV_L2_COLS)) &&
        epd_gemv_rows(y, ldy, x, wt, ldw, bias, m, k, n) == 0)
        return;
    for (int64_t r = 0; r < m; r++) {
        if (bias) memcpy(y + r * ldy, bias, sizeof(float) * (size_t)n);
        else memset(y + r * ldy, 0, sizeof(float) * (size_t)n);
    }
    const int64_t g = k / 8, gs = g * ldw;
    for (int64_t i = 0; i < g; i++) {
        const float *w0 = wt + i * ldw, *w1 = w0 + gs, *w2 = w1 + gs, *w3 = w2 + gs;
        const float *w4 = w3 + gs, *w5 = w4 + gs, *w6 = w5 + gs, *w7 = w6 + gs;
        for (int64_t r = 0; r < m; r++) {
            const float *a = x + r * k + i;
            const float a0 = a[0], a1 = a[g], a2 = a[2 * g], a3 = a[3 * g];
            const float a4 = a[4 * g], a5 = a[5 * g], a6 = a[6 * g], a7 = a[7 * g];
            float *yr = y + r * ldy;
            /* y += a_0 w_0, then a_1 w_1, ... a_7 w_7, each fused: epd_gemv_rows' order */
            for (int64_t j = 0; j < n; j++) {
                float s = fma1(a0, w0[j], yr[j]);
                s = fma1(a1, w1[j], s), s = fma1(a2, w2[j], s), s = fma1(a3, w3[j], s);
                s = fma1(a4, w4[j], s), s = fma1(a5, w5[j], s), s = fma1(a6, w6[j], s);
                yr[j] = fma1(a7, w7[j], s);
            }
        }
    }
    for (int64_t kk = 8 * g; kk < k; kk++)
        for (int64_t r = 0; r < m; r++) axpy(y + r * ldy, x[r * k + kk], wt + kk * ldw, n);
}

/* y[r, :n] = x[r, :k] @ w[:n, :k]^T (+ bias) for a few rows r, w row-major (nn.Linear's
 * [out, in]) with row stride ldw: one dot product per weight row, read once as a single
 * sequential stream while x stays in L1. On the [32000, 512] LM head this reads ~5 %
 * faster than epd_gemv_t (no partial sums to carry through L2); on a layer's small
 * matrices the long streams of epd_gemv_t win, so models keep those as W^T. RW partial
 * sums per dot product, then a tree: deterministic, and vectorized without -ffast-math. */
#define RW 32
void epd_gemv_rm(float *y, int64_t ldy, const float *x, const float *w, int64_t ldw,
                 const float *bias, int64_t m, int64_t k, int64_t n) {
    for (int64_t j = 0; j < n; j++) {
        const float *wj = w + j * ldw;
        for (int64_t r = 0; r < m; r++) {
            const float *xr = x + r * k;
            float acc[RW] = {0};
            int64_t i = 0;
            for (; i + RW <= k; i += RW)
                for (int q = 0; q < RW; q++) acc[q] += wj[i + q] * xr[i + q];
            float s = 0.f;
            for (; i < k; i++) s += wj[i] * xr[i];
            y[r * ldy + j] = tree_sum(acc, RW) + s + (bias ? bias[j] : 0.f);
        }
    }
}

/* out[m, :h] = silu(x[m, :h]) * x[m, h:2h]  (x is the fused gate/up projection). */
void epd_silu_mul(float *out, const float *x, int64_t m, int64_t h) {
    for (int64_t r = 0; r < m; r++) {
        const float *g = x + r * 2 * h, *u = g + h;
        float *o = out + r * h;
        int64_t i = 0;
        /* exp8 by hand: left to GCC, this loop ran at ~5 ns an element, 5x torch's */
        for (; i + 8 <= h; i += 8) {
            const v8 gv = load8(g + i);
            const v8 y = gv / (1.f + exp8(-gv)) * load8(u + i);
            memcpy(o + i, &y, sizeof y);
        }
        for (; i < h; i++) o[i] = g[i] / (1.f + exp_approx(-g[i])) * u[i];
    }
}

/* RMSNorm of rows of x (width h), fp32 sums. With resid: s = x + resid is written to
 * resid_out and normalised; without: x itself is. */
void epd_rms_norm(float *out, float *resid_out, const float *x, const float *resid,
                  const float *w, int64_t m, int64_t h, float eps) {
    for (int64_t r = 0; r < m; r++) {
        const float *xr = x + r * h;
        if (resid) {
            float *s = resid_out + r * h;
            const float *rr = resid + r * h;
            for (int64_t i = 0; i < h; i++) s[i] = xr[i] + rr[i];
            xr = s;
        }
        const float inv = 1.f / sqrtf(dot(xr, xr, h) / (float)h + eps);
        float *o = out + r * h;
        for (int64_t i = 0; i < h; i++) o[i] = w[i] * (xr[i] * inv);
    }
}

static inline void rotate(float *x, const float *cos, const float *sin, int64_t half, int neox) {
    if (neox) {
        float *x2 = x + half;
        for (int64_t i = 0; i < half; i++) {
            const float a = x[i], b = x2[i];
            x[i] = a * cos[i] - b * sin[i];
            x2[i] = b * cos[i] + a * sin[i];
        }
    } else {
        for (int64_t i = 0; i < half; i++) {
            const float a = x[2 * i], b = x[2 * i + 1];
            x[2 * i] = a * cos[i] - b * sin[i];
            x[2 * i + 1] = b * cos[i] + a * sin[i];
        }
    }
}

/* Rotary embedding in place on the first `rot` features of every head of q [t, hq, d]
 * and k [t, hkv, d] (contiguous); cs [max_pos, rot] holds cos | sin for each position. */
void epd_rotary(float *q, float *k, const int64_t *pos, const float *cs, int64_t t, int64_t hq,
                int64_t hkv, int64_t d, int64_t rot, int neox) {
    const int64_t half = rot / 2;
    for (int64_t i = 0; i < t; i++) {
        const float *cos = cs + pos[i] * rot, *sin = cos + half;
        for (int64_t h = 0; h < hq; h++) rotate(q + (i * hq + h) * d, cos, sin, half, neox);
        for (int64_t h = 0; h < hkv; h++) rotate(k + (i * hkv + h) * d, cos, sin, half, neox);
    }
}

/* out[r] = index of the largest of x[r, :n], the first one on ties (torch.argmax's rule).
 * Per-lane maxima and their first indices, then the lanes merged: one vectorized pass.
 * NaN never wins (torch would return it); logits with NaN are garbage either way. */
void epd_argmax(int64_t *out, const float *x, int64_t m, int64_t n) {
    for (int64_t r = 0; r < m; r++) {
        const float *xr = x + r * n;
        float mx[VW];
        int64_t ix[VW];
        for (int j = 0; j < VW; j++) {
            mx[j] = -INFINITY;
            ix[j] = INT64_MAX;
        }
        int64_t i = 0;
        for (; i + VW <= n; i += VW)
            for (int j = 0; j < VW; j++)
                if (xr[i + j] > mx[j]) {
                    mx[j] = xr[i + j];
                    ix[j] = i + j;
                }
        float best = -INFINITY;
        int64_t at = n > 0 ? 0 : -1;
        for (int j = 0; j < VW; j++)
            if (mx[j] > best || (mx[j] == best && ix[j] < at)) {
                best = mx[j];
                at = ix[j];
            }
        for (; i < n; i++)
            if (xr[i] > best) {
                best = xr[i];
                at = i;
            }
        out[r] = at == INT64_MAX ? 0 : at;
    }
}

/* out[r] = argmax of the logits x[r, :k] @ W^T, W [n, k] the LM head: greedy tokens
 * straight from the head, the logits never leaving this call. w holds W row-major
 * (transposed = 0) or W^T row-major (transposed = 1). Returns 0, or -1 when the logits'
 * scratch is short. */
int epd_gemv_argmax(int64_t *out, const float *x, const float *w, int64_t m, int64_t k,
                    int64_t n, int transposed) {
    float *y = malloc(sizeof(float) * (size_t)(m * n));
    if (!y) return -1;
    if (transposed) epd_gemv_t(y, n, x, w, n, NULL, m, k, n);
    else epd_gemv_rm(y, n, x, w, k, NULL, m, k, n);
    epd_argmax(out, y, m, n);
    free(y);
    return 0;
}
