/* Products with quantized weights (services/kernels/quant.py), for any number of rows:
 * y[r, j] = x[r, :] . w[:, j] with w dequantized in registers, never in memory.
 *
 * Layout: the columns come in panels of 16, each panel's K rows one after another (panel
 * p, row kk at qw + (p * k + kk) * 16 for int8, half that for int4), so one panel is one
 * sequential stream however many columns the matrix has. int8: per-column scales,
 * y = scale[j] * sum_k x[k] q[k, j] (+ bias[j]). int4: bytes hold column i (low nibble)
 * and column i + 8 (high nibble) of a panel; unsigned codes u with, per group of
 * `group` rows and per column, a scale s and an offset o = -zero * s:
 * y = sum_g (s_g * sum_{k in g} x[k] u[k, j] + o_g * sum_{k in g} x[k]) (+ bias[j]).
 *
 * Sum order: every output element is one chain of fused multiply-adds over k in order (and
 * for int4 over groups in order), whichever block of rows or panels it is computed in, so a
 * row's result does not depend on its batch or on the thread split. Blocks differ only in
 * how many chains run side by side: R rows of one panel share each weight vector
 * converted once (R = 6 for int8, 3 for int4: the AVX2 register file), and a single row
 * runs S panels at once so enough chains are in flight to stream the weights.
 */
#include "epd_common.h"

#define PANEL 16
#define I8_ARGS                                                                               \
    float *y, int64_t ldy, const float *x, int64_t ldx, int64_t k, const int8_t *qw,         \
        const float *scale, const float *bias, int64_t cols
#define I4_ARGS                                                                               \
    float *y, int64_t ldy, const float *x, int64_t ldx, const float *xs, int64_t ldxs,       \
        int64_t k, int64_t group, const uint8_t *qw, const float *scale, const float *offset, \
        int64_t lds, const float *bias, int64_t cols

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

static inline __m256 i8_8(const int8_t *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}

/* The 16 codes of a panel row of int4: columns 0-7 (low nibbles) and 8-15 (high). */
static inline void u4_16(const uint8_t *p, __m256 *lo, __m256 *hi) {
    const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
    *lo = _mm256_cvtepi32_ps(_mm256_and_si256(v, _mm256_set1_epi32(15)));
    *hi = _mm256_cvtepi32_ps(_mm256_srli_epi32(v, 4));
}

/* y[:cols] = a * scale + b (cols <= 0: nothing; past 16: 16) for one row of one panel. */
static inline void store_panel(float *y, __m256 a0, __m256 a1, const float *scale,
                               const float *bias, int64_t cols) {
    if (cols <= 0) return;
    const int64_t nc = cols < PANEL ? cols : PANEL;
    float out[PANEL], b[PANEL] = {0};
    if (bias) memcpy(b, bias, sizeof(float) * (size_t)nc);
    const __m256 s0 = _mm256_loadu_ps(scale), s1 = _mm256_loadu_ps(scale + 8);
    _mm256_storeu_ps(out, _mm256_fmadd_ps(a0, s0, _mm256_loadu_ps(b)));
    _mm256_storeu_ps(out + 8, _mm256_fmadd_ps(a1, s1, _mm256_loadu_ps(b + 8)));
    memcpy(y, out, sizeof(float) * (size_t)nc);
}

/* The blocks below keep each accumulator in a variable of its own, a0 / b0 (columns 0-7 /
 * 8-15 of row or panel 0) and so on, with the unused ones dropped by `if (rows > i)` on a
 * constant: GCC keeps an accumulator array in memory here, storing it on every k (the code
 * loads may alias it). */
#define Z _mm256_setzero_ps()
#define ACCS __m256 a0 = Z, b0 = Z, a1 = Z, b1 = Z, a2 = Z, b2 = Z, a3 = Z, b3 = Z, a4 = Z, b4 = Z, a5 = Z, b5 = Z
#define FMA_ROW(i)                                                                            \
    if (rows > i) {                                                                           \
        const __m256 xb = _mm256_broadcast_ss(x + i * ldx + kk);                              \
        a##i = _mm256_fmadd_ps(w0, xb, a##i);                                                 \
        b##i = _mm256_fmadd_ps(w1, xb, b##i);                                                 \
    }
#define FMA_ROWS FMA_ROW(0) FMA_ROW(1) FMA_ROW(2) FMA_ROW(3) FMA_ROW(4) FMA_ROW(5)
#define STORE_ROW(i, SCALE)                                                                   \
    if (rows > i) store_panel(y + i * ldy, a##i, b##i, SCALE, bias, cols);
#define STORE_ROWS(SCALE)                                                                     \
    STORE_ROW(0, SCALE) STORE_ROW(1, SCALE) STORE_ROW(2, SCALE) STORE_ROW(3, SCALE)           \
    STORE_ROW(4, SCALE) STORE_ROW(5, SCALE)

/* Rows [0, R) (R <= 6) of x times the panel at qw into y. */
#define I8_BLOCK(R)                                                                           \
    static void i8_block_##R(I8_ARGS) {                                                       \
        const int rows = R;                                                                   \
        ACCS;                                                                                 \
        for (int64_t kk = 0; kk < k; kk++) {                                                  \
            const __m256 w0 = i8_8(qw + kk * PANEL), w1 = i8_8(qw + kk * PANEL + 8);          \
            FMA_ROWS                                                                          \
        }                                                                                     \
        STORE_ROWS(scale)                                                                     \
        (void)a5, (void)b5, (void)a4, (void)b4, (void)a3, (void)b3, (void)a2, (void)b2,       \
            (void)a1, (void)b1;                                                               \
    }

/* One row of x times four panels (a single row has too few chains in flight otherwise). */
static void i8_block_1x4(I8_ARGS) {
    ACCS;
    const float *x0 = x;
    for (int64_t kk = 0; kk < k; kk++) {
        const __m256 xb = _mm256_broadcast_ss(x0 + kk);
        const int8_t *p = qw + kk * PANEL;
        a0 = _mm256_fmadd_ps(i8_8(p), xb, a0), b0 = _mm256_fmadd_ps(i8_8(p + 8), xb, b0);
        p += k * PANEL;
        a1 = _mm256_fmadd_ps(i8_8(p), xb, a1), b1 = _mm256_fmadd_ps(i8_8(p + 8), xb, b1);
        p += k * PANEL;
        a2 = _mm256_fmadd_ps(i8_8(p), xb, a2), b2 = _mm256_fmadd_ps(i8_8(p + 8), xb, b2);
        p += k * PANEL;
        a3 = _mm256_fmadd_ps(i8_8(p), xb, a3), b3 = _mm256_fmadd_ps(i8_8(p + 8), xb, b3);
    }
    store_panel(y, a0, b0, scale, bias, cols);
    store_panel(y + PANEL, a1, b1, scale + PANEL, bias ? bias + PANEL : NULL, cols - PANEL);
    store_panel(y + 2 * PANEL, a2, b2, scale + 2 * PANEL, bias ? bias + 2 * PANEL : NULL,
                cols - 2 * PANEL);
    store_panel(y + 3 * PANEL, a3, b3, scale + 3 * PANEL, bias ? bias + 3 * PANEL : NULL,
                cols - 3 * PANEL);
    (void)a4, (void)b4, (void)a5, (void)b5;
}

/* The int4 block, rows [0, R) (R <= 3): per group the codes' products summed (a, b),
 * then scaled and offset into the outputs (the a / b of rows 3-5). */
#define GROUP_END(i, o)                                                                       \
    if (rows > i) {                                                                           \
        const __m256 xsum = _mm256_broadcast_ss(xs + i * ldxs + g);                           \
        a##o = _mm256_fmadd_ps(o0, xsum, _mm256_fmadd_ps(s0, a##i, a##o));                    \
        b##o = _mm256_fmadd_ps(o1, xsum, _mm256_fmadd_ps(s1, b##i, b##o));                    \
        a##i = b##i = Z;                                                                      \
    }
#define I4_BLOCK(R)                                                                           \
    static void i4_block_##R(I4_ARGS) {                                                       \
        const int rows = R;                                                                   \
        ACCS;                                                                                 \
        for (int64_t g = 0; g * group < k; g++) {                                             \
            for (int64_t kk = g * group; kk < (g + 1) * group; kk++) {                        \
                __m256 w0, w1;                                                                \
                u4_16(qw + kk * (PANEL / 2), &w0, &w1);                                       \
                FMA_ROW(0) FMA_ROW(1) FMA_ROW(2)                                              \
            }                                                                                 \
            const float *sc = scale + g * lds, *of = offset + g * lds;                        \
            const __m256 s0 = _mm256_loadu_ps(sc), s1 = _mm256_loadu_ps(sc + 8);              \
            const __m256 o0 = _mm256_loadu_ps(of), o1 = _mm256_loadu_ps(of + 8);              \
            GROUP_END(0, 3) GROUP_END(1, 4) GROUP_END(2, 5)                                   \
        }                                                                                     \
        static const float one[PANEL] = {1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1};    \
        if (R > 0) store_panel(y, a3, b3, one, bias, cols);                                   \
        if (R > 1) store_panel(y + ldy, a4, b4, one, bias, cols);                             \
        if (R > 2) store_panel(y + 2 * ldy, a5, b5, one, bias, cols);                         \
    }

/* One row of x times three panels: the int4 block across panels (acc of panel s in
 * a_s / b_s, its output in a_{s+3} / b_{s+3}). */
#define PANEL_FMA(s)                                                                          \
    {                                                                                         \
        __m256 w0, w1;                                                                        \
        u4_16(qw + (s * k + kk) * (PANEL / 2), &w0, &w1);                                     \
        a##s = _mm256_fmadd_ps(w0, xb, a##s);                                                 \
        b##s = _mm256_fmadd_ps(w1, xb, b##s);                                                 \
    }
#define PANEL_END(s, o)                                                                       \
    {                                                                                         \
        const float *sc = scale + g * lds + s * PANEL, *of = offset + g * lds + s * PANEL;    \
        a##o = _mm256_fmadd_ps(_mm256_loadu_ps(of), xsum,                                     \
                               _mm256_fmadd_ps(_mm256_loadu_ps(sc), a##s, a##o));             \
        b##o = _mm256_fmadd_ps(_mm256_loadu_ps(of + 8), xsum,                                 \
                               _mm256_fmadd_ps(_mm256_loadu_ps(sc + 8), b##s, b##o));         \
        a##s = b##s = Z;                                                                      \
    }
static void i4_block_1x3(I4_ARGS) {
    ACCS;
    for (int64_t g = 0; g * group < k; g++) {
        for (int64_t kk = g * group; kk < (g + 1) * group; kk++) {
            const __m256 xb = _mm256_broadcast_ss(x + kk);
            PANEL_FMA(0) PANEL_FMA(1) PANEL_FMA(2)
        }
        const __m256 xsum = _mm256_broadcast_ss(xs + g);
        PANEL_END(0, 3) PANEL_END(1, 4) PANEL_END(2, 5)
    }
    static const float one[PANEL] = {1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1};
    store_panel(y, a3, b3, one, bias, cols);
    store_panel(y + PANEL, a4, b4, one, bias ? bias + PANEL : NULL, cols - PANEL);
    store_panel(y + 2 * PANEL, a5, b5, one, bias ? bias + 2 * PANEL : NULL, cols - 2 * PANEL);
    (void)ldy, (void)ldx, (void)ldxs;
}

#else /* the same sums, one element at a time */

static void i8_scalar(I8_ARGS, int R, int S) {
    for (int s = 0; s < S; s++)
        for (int r = 0; r < R; r++)
            for (int64_t c = 0; c < PANEL && s * PANEL + c < cols; c++) {
                float a = 0.f;
                for (int64_t kk = 0; kk < k; kk++)
                    a = fma1((float)qw[(s * k + kk) * PANEL + c], x[r * ldx + kk], a);
                const int64_t j = s * PANEL + c;
                y[r * ldy + j] = fma1(a, scale[j], bias ? bias[j] : 0.f);
            }
}

static void i4_scalar(I4_ARGS, int R, int S) {
    for (int s = 0; s < S; s++)
        for (int r = 0; r < R; r++)
            for (int64_t c = 0; c < PANEL && s * PANEL + c < cols; c++) {
                const int64_t j = s * PANEL + c;
                float o = 0.f;
                for (int64_t g = 0; g * group < k; g++) {
                    float a = 0.f;
                    for (int64_t kk = g * group; kk < (g + 1) * group; kk++) {
                        const uint8_t b = qw[(s * k + kk) * (PANEL / 2) + c % 8];
                        a = fma1((float)(c < 8 ? b & 15 : b >> 4), x[r * ldx + kk], a);
                    }
                    o = fma1(offset[g * lds + j], xs[r * ldxs + g], fma1(scale[g * lds + j], a, o));
                }
                y[r * ldy + j] = fma1(o, 1.f, bias ? bias[j] : 0.f);
            }
}

#define I8_BLOCK(R)                                                                           \
    static void i8_block_##R(I8_ARGS) { i8_scalar(y, ldy, x, ldx, k, qw, scale, bias, cols, R, 1); }
static void i8_block_1x4(I8_ARGS) { i8_scalar(y, ldy, x, ldx, k, qw, scale, bias, cols, 1, 4); }
static void i4_block_1x3(I4_ARGS) {
    i4_scalar(y, ldy, x, ldx, xs, ldxs, k, group, qw, scale, offset, lds, bias, cols, 1, 3);
}
#define I4_BLOCK(R)                                                                           \
    static void i4_block_##R(I4_ARGS) {                                                       \
        i4_scalar(y, ldy, x, ldx, xs, ldxs, k, group, qw, scale, offset, lds, bias, cols, R, 1); \
    }
#endif

I8_BLOCK(1)
I8_BLOCK(2)
I8_BLOCK(3)
I8_BLOCK(4)
I8_BLOCK(5)
I8_BLOCK(6)
I4_BLOCK(1)
I4_BLOCK(2)
I4_BLOCK(3)

typedef void (*i8_fn)(I8_ARGS);
typedef void (*i4_fn)(I4_ARGS);
/* The block for the last 1-5 (int8) or 1-2 (int4) rows of a panel. */
static const i8_fn I8_TAIL[6] = {NULL, i8_block_1, i8_block_2, i8_block_3, i8_block_4,
                                 i8_block_5};
static const i4_fn I4_TAIL[3] = {NULL, i4_block_1, i4_block_2};

/* Columns of panels [p0, p1) of every row of x [m, k] (row stride ldx) into y (stride
 * ldy); n columns in all (the last panel may be partial). */
void epd_qgemv_i8(float *y, int64_t ldy, const float *x, int64_t ldx, int64_t m, int64_t k,
                  int64_t n, const int8_t *qw, const float *scale, const float *bias, int64_t p0,
                  int64_t p1) {
    for (int64_t p = p0; p < p1;) {
        const int64_t c0 = p * PANEL, cols = n - c0;
        const int8_t *w = qw + p * k * PANEL;
        const float *b = bias ? bias + c0 : NULL;
        if (m == 1 && p + 4 <= p1) {
            i8_block_1x4(y + c0, ldy, x, ldx, k, w, scale + c0, b, cols);
            p += 4;
            continue;
        }
        int64_t r = 0;
        for (; r + 6 <= m; r += 6)
            i8_block_6(y + r * ldy + c0, ldy, x + r * ldx, ldx, k, w, scale + c0, b, cols);
        if (r < m) I8_TAIL[m - r](y + r * ldy + c0, ldy, x + r * ldx, ldx, k, w, scale + c0, b, cols);
        p += 1;
    }
}

/* xs[r, g] = the sum of row r of x over group g (k / group groups), in order. */
void epd_group_sums(float *xs, const float *x, int64_t ldx, int64_t m, int64_t k, int64_t group) {
    for (int64_t r = 0; r < m; r++)
        for (int64_t g = 0; g < k / group; g++) {
            float s = 0.f;
            for (int64_t kk = g * group; kk < (g + 1) * group; kk++) s += x[r * ldx + kk];
            xs[r * (k / group) + g] = s;
        }
}

/* epd_qgemv_i8's contract for int4 codes; xs [m, k / group]: each row's sum per group
 * (epd_group_sums); scale and offset [k / group, lds]. */
void epd_qgemv_i4(float *y, int64_t ldy, const float *x, int64_t ldx, const float *xs,
                  int64_t m, int64_t k, int64_t n, int64_t group, const uint8_t *qw,
                  const float *scale, const float *offset, int64_t lds, const float *bias,
                  int64_t p0, int64_t p1) {
    const int64_t ng = k / group;
    for (int64_t p = p0; p < p1;) {
        const int64_t c0 = p * PANEL, cols = n - c0;
        const uint8_t *w = qw + p * k * (PANEL / 2);
        const float *b = bias ? bias + c0 : NULL, *sc = scale + c0, *of = offset + c0;
        if (m == 1 && p + 3 <= p1) {
            i4_block_1x3(y + c0, ldy, x, ldx, xs, ng, k, group, w, sc, of, lds, b, cols);
            p += 3;
            continue;
        }
        int64_t r = 0;
        for (; r + 3 <= m; r += 3)
            i4_block_3(y + r * ldy + c0, ldy, x + r * ldx, ldx, xs + r * ng, ng, k, group, w,
                         sc, of, lds, b, cols);
        if (r < m)
            I4_TAIL[m - r](y + r * ldy + c0, ldy, x + r * ldx, ldx, xs + r * ng, ng, k, group, w,
                           sc, of, lds, b, cols);
        p += 1;
    }
}
