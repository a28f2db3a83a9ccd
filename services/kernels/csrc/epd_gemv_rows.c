/* The multi-row GEMV behind epd_gemv_t (epd_cpu.c): y[r, :n] = x[r, :k] @ wt[:k, :n] for
 * 2 rows or more, every output element summed exactly as the one-row kernel sums it.
 *
 * The one-row kernel streams eight k-runs of wt side by side and reloads the eight weight
 * vectors for every output row: past one row it is bound by those loads (from L2, or L3 on
 * an LM head), not by memory. Here each eight-float column vector of the eight weight rows
 * is loaded once into registers and used by every row of the call, rows taken two at a
 * time (two independent add chains in flight). x's values come pre-broadcast (one vector
 * load each, folded into the multiply). Sums go to a private accumulator whose row stride
 * is an odd multiple of 64 bytes: with y's own stride (often a multiple of 4 KB, e.g.
 * n = 1024) a row's load waits on the previous row's store to the same 4 KB offset.
 * Columns are cut in tiles whose accumulator rows stay within L2 (an LM head's 32,000). The
 * sum order of every element is the one-row kernel's: starting from the bias, the products
 * a_0 w_0, ..., a_7 w_7 of pass 0, then of pass 1, ..., each added with one fused
 * multiply-add (fma8: explicit, so both kernels fuse the same operations), so a row's
 * result does not depend on its batch. Fused, a row costs 8 arithmetic instructions per
 * eight columns against 15 for products summed then added: at 32 rows this kernel is bound
 * by them, not by the weight reads. For the same reason it steps sixteen columns at a time
 * where the CPU has AVX-512 (pass16): twice the work per instruction, the same sums per
 * element (the build's -march=native otherwise keeps GCC at 256-bit vectors).
 */
#include "epd_common.h"

#define ROW_BLOCK 32          /* rows sharing one pass over the weights */
#define ACC_BYTES (256 << 10) /* accumulator of one column tile: about half of L2 */

static inline void store8(float *p, v8 v) { memcpy(p, &v, sizeof v); }

/* y + a_0 w_0 + ... + a_7 w_7, one fused product at a time (the one-row kernel's order). */
#define CHAIN(FMA, Y, A)                                                                      \
    FMA(W7, A[7], FMA(W6, A[6], FMA(W5, A[5], FMA(W4, A[4], FMA(W3, A[3], FMA(W2, A[2],     \
        FMA(W1, A[1], FMA(W0, A[0], Y))))))))

/* One column step of pass(), at column j, in vectors of type V: the eight weight vectors
 * loaded once into registers, then added into every row's accumulator, rows two at a time
 * (two add chains in flight). */
#define COLUMN_STEP(V, LOAD, STORE, FMA)                                                      \
    do {                                                                                      \
        const V W0 = LOAD(w[0] + j), W1 = LOAD(w[1] + j), W2 = LOAD(w[2] + j);               \
        const V W3 = LOAD(w[3] + j), W4 = LOAD(w[4] + j), W5 = LOAD(w[5] + j);               \
        const V W6 = LOAD(w[6] + j), W7 = LOAD(w[7] + j);                                    \
        int64_t r = 0;                                                                        \
        for (; r + 2 <= m; r += 2) {                                                          \
            const v8 *A = a + 8 * r, *B = A + 8;                                              \
            float *y0 = acc + r * lda + j, *y1 = y0 + lda;                                    \
            const V u0 = CHAIN(FMA, LOAD(y0), A), u1 = CHAIN(FMA, LOAD(y1), B);              \
            STORE(y0, u0);                                                                    \
            STORE(y1, u1);                                                                    \
        }                                                                                     \
        if (r < m) {                                                                          \
            const v8 *A = a + 8 * r;                                                          \
            float *y0 = acc + r * lda + j;                                                    \
            STORE(y0, CHAIN(FMA, LOAD(y0), A));                                               \
        }                                                                                     \
    } while (0)

#if defined(__AVX512F__)
static inline void store16(float *p, v16 v) { memcpy(p, &v, sizeof v); }
/* w * x[0] + y on sixteen lanes (x: a pre-broadcast v8 of pass()'s a[]) */
static inline v16 fma16_x(v16 w, v8 x, v16 y) {
    return (v16)_mm512_fmadd_ps((__m512)w, _mm512_set1_ps(x[0]), (__m512)y);
}

/* pass()'s columns sixteen at a time, on AVX-512 registers: per element the same sums;
 * returns how many columns it took. */
static int64_t pass16(float *acc, int64_t lda, const v8 *a, const float *const *w, int64_t m,
                      int64_t n) {
    const int64_t nv = n / 16 * 16;
    for (int64_t j = 0; j < nv; j += 16) COLUMN_STEP(v16, load16, store16, fma16_x);
    return nv;
}
#else
#define pass16(acc, lda, a, w, m, n) ((int64_t)0) /* pass's eight-column steps take them all */
#endif

/* acc[r, :n] += the products of the eight weight rows w[0..7] (each at its own k-run) of
 * pass i, a[r * 8 + q] = x[r, q-th run's row i] broadcast. */
static void pass(float *acc, int64_t lda, const v8 *a, const float *const *w, int64_t m,
                 int64_t n) {
    const int64_t nv = n / 8 * 8;
    for (int64_t j = pass16(acc, lda, a, w, m, n); j < nv; j += 8)
        COLUMN_STEP(v8, load8, store8, fma8);
    for (int64_t j = nv; j < n; j++)
        for (int64_t r = 0; r < m; r++) {
            const v8 *A = a + 8 * r;
            float s = acc[r * lda + j];
            for (int q = 0; q < 8; q++) s = fma1(A[q][0], w[q][j], s);
            acc[r * lda + j] = s;
        }
}

/* One column tile [n] of up to ROW_BLOCK rows, through the accumulator acc (stride lda). */
static void tile(float *y, int64_t ldy, const float *x, const float *wt, int64_t ldw,
                 const float *bias, int64_t m, int64_t k, int64_t n, float *acc, int64_t lda) {
    for (int64_t r = 0; r < m; r++) {
        if (bias) memcpy(acc + r * lda, bias, sizeof(float) * (size_t)n);
        else memset(acc + r * lda, 0, sizeof(float) * (size_t)n);
    }
    const int64_t g = k / 8, gs = g * ldw;
    v8 a[ROW_BLOCK * 8];
    for (int64_t i = 0; i < g; i++) {
        const float *w[8];
        for (int q = 0; q < 8; q++) w[q] = wt + i * ldw + q * gs;
        for (int64_t r = 0; r < m; r++)
            for (int q = 0; q < 8; q++) a[r * 8 + q] = (v8){0} + x[r * k + i + q * g];
        pass(acc, lda, a, w, m, n);
    }
    for (int64_t kk = 8 * g; kk < k; kk++)
        for (int64_t r = 0; r < m; r++) axpy(acc + r * lda, x[r * k + kk], wt + kk * ldw, n);
    for (int64_t r = 0; r < m; r++)
        memcpy(y + r * ldy, acc + r * lda, sizeof(float) * (size_t)n);
}

/* epd_gemv_t's contract for any m; returns -1 (nothing written) when the accumulator
 * cannot be allocated. */
int epd_gemv_rows(float *y, int64_t ldy, const float *x, const float *wt, int64_t ldw,
                  const float *bias, int64_t m, int64_t k, int64_t n) {
    const int64_t rows = m < ROW_BLOCK ? m : ROW_BLOCK;
    int64_t cols = ACC_BYTES / (int64_t)sizeof(float) / (rows > 0 ? rows : 1) / 64 * 64;
    cols = cols < 64 ? 64 : (cols > n ? n : cols);
    int64_t lda = (cols + 15) / 16 * 16;
    if ((lda / 16) % 2 == 0) lda += 16; /* an odd multiple of 64 bytes: rows never alias */
    float *acc = aligned_alloc(64, sizeof(float) * (size_t)(rows * lda));
    if (!acc) return -1;
    for (int64_t r0 = 0; r0 < m; r0 += ROW_BLOCK) {
        const int64_t mb = m - r0 < ROW_BLOCK ? m - r0 : ROW_BLOCK;
        for (int64_t j0 = 0; j0 < n; j0 += cols) {
            const int64_t nb = n - j0 < cols ? n - j0 : cols;
            tile(y + r0 * ldy + j0, ldy, x + r0 * k, wt + j0, ldw, bias ? bias + j0 : NULL, mb,
                 k, nb, acc, lda);
        }
    }
    free(acc);
    return 0;
}
