/* Helpers shared by the native CPU kernels (epd_*.c): fp32, written so
 * the compiler vectorizes them without -ffast-math. */
#ifndef EPD_COMMON_H
#define EPD_COMMON_H

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* Eight floats as one value (GCC/Clang vector extension: AVX on x86, NEON pairs on Arm). */
typedef float v8 __attribute__((vector_size(32)));

static inline v8 load8(const float *p) {
    v8 v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* a * b + c, fused (one rounding) where the CPU has FMA, else a multiply and an add. Written
 * out, never left to the compiler: -std=c11 keeps GCC from contracting a * b + c on its own,
 * so every kernel that sums the same way gets the same bits (the GEMVs rely on it). Half the
 * arithmetic instructions of the unfused form: the multi-row GEMV is bound by them. */
#if defined(__FMA__) && (defined(__x86_64__) || defined(__i386__))
#include <immintrin.h>
static inline v8 fma8(v8 a, v8 b, v8 c) { return (v8)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c); }
static inline float fma1(float a, float b, float c) { return fmaf(a, b, c); }
#else
static inline v8 fma8(v8 a, v8 b, v8 c) { return a * b + c; }
static inline float fma1(float a, float b, float c) { return a * b + c; }
#endif

/* Sixteen floats as one value: one AVX-512 register, or two AVX ones (GCC splits it;
 * these helpers are static inline, so the ABI note GCC gives for them does not apply). */
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wpsabi"
#endif
typedef float v16 __attribute__((vector_size(64)));

static inline v16 load16(const float *p) {
    v16 v;
    memcpy(&v, p, sizeof v);
    return v;
}

#if defined(__AVX512F__)
static inline v8 lo8(v16 v) { return (v8)_mm512_castps512_ps256((__m512)v); }
static inline v8 hi8(v16 v) {
    return (v8)_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd((__m512)v), 1));
}
#else
static inline v8 lo8(v16 v) {
    v8 r;
    memcpy(&r, &v, sizeof r);
    return r;
}
static inline v8 hi8(v16 v) {
    v8 r;
    memcpy(&r, (const char *)&v + sizeof r, sizeof r);
    return r;
}
#endif

/* a * b + c on sixteen lanes, fused as fma8 fuses (the same bits lane by lane). */
static inline v16 fma16(v16 a, v16 b, v16 c) {
#if defined(__AVX512F__)
    return (v16)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#else
    const v8 l = fma8(lo8(a), lo8(b), lo8(c)), h = fma8(hi8(a), hi8(b), hi8(c));
    v16 r;
    memcpy(&r, &l, sizeof l);
    memcpy((char *)&r + sizeof l, &h, sizeof h);
    return r;
#endif
}

#define VW 8 /* partial sums per reduction (8 beat 4 and 16 on the attention here) */

/* Sum of VW partial sums as a tree (vectorizes; a serial chain would cost ~VW adds of
 * latency for every short dot product). */
static inline float tree_sum(float *acc, int n) { /* n a power of two */
    for (int w = n / 2; w > 0; w /= 2)
        for (int j = 0; j < w; j++) acc[j] += acc[j + w];
    return acc[0];
}

static inline float hsum(float *acc) { return tree_sum(acc, VW); }

static inline float dot(const float *a, const float *b, int64_t n) {
    float acc[VW] = {0};
    int64_t i = 0;
    for (; i + VW <= n; i += VW)
        for (int j = 0; j < VW; j++) acc[j] += a[i + j] * b[i + j];
    float s = 0.f;
    for (; i < n; i++) s += a[i] * b[i];
    return s + hsum(acc);
}

/* e^x for x <= 0 ... 88, branch-free so loops over it vectorize (libm's expf does not
 * without -ffast-math). x = n ln2 + r, |r| <= ln2/2; e^r by a degree-6 Taylor polynomial
 * (relative error < 2e-7, about one float ulp); 2^n built in the exponent bits. */
static inline float exp_approx(float x) {
    x = x < -87.f ? -87.f : (x > 88.f ? 88.f : x);
    const float magic = 12582912.f; /* 1.5 * 2^23: adding it rounds to an integer */
    const float n = (x * 1.44269504088896341f + magic) - magic;
    const float r = (x - n * 0.693145751953125f) - n * 1.428606765330187e-06f;
    float p = 1.f / 720.f;
    p = p * r + 1.f / 120.f;
    p = p * r + 1.f / 24.f;
    p = p * r + 1.f / 6.f;
    p = p * r + 0.5f;
    p = p * r + 1.f;
    p = p * r + 1.f;
    union { float f; int32_t i; } two_n = {.i = ((int32_t)n + 127) << 23};
    return p * two_n.f;
}

typedef int32_t v8i __attribute__((vector_size(32)));
typedef int32_t v16i __attribute__((vector_size(64)));

static inline v8 splat8(float x) { return (v8){x, x, x, x, x, x, x, x}; }
static inline v16 splat16(float x) {
#if defined(__AVX512F__)
    return (v16)_mm512_set1_ps(x);
#else
    return (v16){x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x};
#endif
}

static inline v8 select8(v8i m, v8 a, v8 b) { return (v8)((m & (v8i)a) | (~m & (v8i)b)); }
static inline v16 select16(v16i m, v16 a, v16 b) { return (v16)((m & (v16i)a) | (~m & (v16i)b)); }

static inline v8 max8(v8 a, v8 b) { return select8(a > b, a, b); }
static inline v16 max16(v16 a, v16 b) { return select16(a > b, a, b); }

/* exp_approx on eight (exp8) or sixteen (exp16) lanes, bitwise the same values (the same
 * operations in the same order): GCC does not vectorize the scalar one well inside a
 * larger loop. */
#define DEFINE_EXP(NAME, V, VI, SPLAT, SELECT, MAX)                                          \
    static inline V NAME(V x) {                                                              \
        x = MAX(SPLAT(-87.f), x);                                                            \
        x = SELECT(x > SPLAT(88.f), SPLAT(88.f), x);                                         \
        const V magic = SPLAT(12582912.f);                                                   \
        const V n = (x * 1.44269504088896341f + magic) - magic;                              \
        const V r = (x - n * 0.693145751953125f) - n * 1.428606765330187e-06f;               \
        V p = SPLAT(1.f / 720.f);                                                            \
        p = p * r + 1.f / 120.f;                                                             \
        p = p * r + 1.f / 24.f;                                                              \
        p = p * r + 1.f / 6.f;                                                               \
        p = p * r + 0.5f;                                                                    \
        p = p * r + 1.f;                                                                     \
        p = p * r + 1.f;                                                                     \
        const VI e = (__builtin_convertvector(n, VI) + 127) << 23;                           \
        return p * (V)e;                                                                     \
    }
DEFINE_EXP(exp8, v8, v8i, splat8, select8, max8)
DEFINE_EXP(exp16, v16, v16i, splat16, select16, max16)
#undef DEFINE_EXP

static inline void axpy(float *y, float a, const float *x, int64_t n) {
    for (int64_t i = 0; i < n; i++) y[i] += a * x[i];
}

/* The kernels one file calls from another (epd_decode.c chains them into a whole step). */
void epd_gemv_t(float *y, int64_t ldy, const float *x, const float *wt, int64_t ldw,
                const float *bias, int64_t m, int64_t k, int64_t n);
int epd_gemv_rows(float *y, int64_t ldy, const float *x, const float *wt, int64_t ldw,
                  const float *bias, int64_t m, int64_t k, int64_t n);
void epd_gemv_rm(float *y, int64_t ldy, const float *x, const float *w, int64_t ldw,
                 const float *bias, int64_t m, int64_t k, int64_t n);
void epd_qgemv_i8(float *y, int64_t ldy, const float *x, int64_t ldx, int64_t m, int64_t k,
                  int64_t n, const int8_t *qw, const float *scale, const float *bias, int64_t p0,
                  int64_t p1);
void epd_group_sums(float *xs, const float *x, int64_t ldx, int64_t m, int64_t k, int64_t group);
void epd_qgemv_i4(float *y, int64_t ldy, const float *x, int64_t ldx, const float *xs,
                  int64_t m, int64_t k, int64_t n, int64_t group, const uint8_t *qw,
                  const float *scale, const float *offset, int64_t lds, const float *bias,
                  int64_t p0, int64_t p1);
void epd_argmax(int64_t *out, const float *x, int64_t m, int64_t n);
int64_t epd_screen_argmax(int64_t *out, const uint16_t *s, const float *x, const float *w,
                          const float *wn, const float *dwn, const float *p, const float *q,
                          int64_t m, int64_t k, int64_t n, int transposed, int64_t cap);
int epd_gemv_bf16(uint16_t *s, int64_t lds, const uint16_t *xb, const uint16_t *wt,
                  int64_t ldw, int64_t m, int64_t k, int64_t n);
void epd_silu_mul(float *out, const float *x, int64_t m, int64_t h);
void epd_rms_norm(float *out, float *resid_out, const float *x, const float *resid,
                  const float *w, int64_t m, int64_t h, float eps);
void epd_rotary(float *q, float *k, const int64_t *pos, const float *cs, int64_t t, int64_t hq,
                int64_t hkv, int64_t d, int64_t rot, int neox);
int epd_decode_attention(float *out, const float *q, const float *kc, const float *vc,
                         const int32_t *tables, int64_t table_stride, const int32_t *lens,
                         const int64_t *rows, const int64_t *seqs, int64_t n, int64_t hq,
                         int64_t hkv, int64_t d, int64_t bs, float scale);
void epd_softmax(float *s, int64_t n);
void epd_kv_quantize(void *dst, const float *x, int64_t n, int64_t d, int fp8);
int epd_decode_attention_q8(float *out, const float *q, const void *kc, const void *vc,
                            const int32_t *tables, int64_t table_stride, const int32_t *lens,
                            const int64_t *rows, const int64_t *seqs, int64_t n, int64_t hq,
                            int64_t hkv, int64_t d, int64_t bs, float scale, int fp8);
int epd_extend_attention(float *out, const float *q, const float *kc, const float *vc,
                         const int32_t *tables, int64_t table_stride, const int64_t *units,
                         int64_t n, int64_t hq, int64_t hkv, int64_t d, int64_t bs, float scale);

/* The one-call decoder step (epd_decode.c), run by a team in epd_parallel.c. */
int epd_decode_stack(float *out, float *aux, const int64_t *aux_cols, int64_t aux_stride,
                     const float *h, const int64_t *layers, const float *final_norm,
                     const float *cs, const int64_t *pos, const int64_t *slots,
                     const int32_t *tables, const int32_t *lens, const int64_t *dm, float eps,
                     float scale, float *scratch, int64_t *sync, int64_t tid, int64_t nt);
int epd_decode_greedy(int64_t *tokens_out, const int64_t *tokens_in, const float *embed,
                      const float *head, int head_transposed, int64_t vocab, int64_t steps,
                      const int64_t *layers, const float *final_norm, const float *cs,
                      const int64_t *pos0, const int32_t *tables, const int32_t *lens0,
                      const int64_t *dm, float eps, float scale, float *scratch, int64_t *sync,
                      int64_t tid, int64_t nt);

#endif
