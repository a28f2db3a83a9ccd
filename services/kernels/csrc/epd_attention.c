/* Paged attention of the "cpu" backend (see epd_cpu.c for how the library is built). */
#include "epd_common.h"

#if defined(__clang__)
#define SHUF(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define SHUF(a, b, ...) __builtin_shuffle(a, b, (v8i){__VA_ARGS__})
#endif

/* Pairwise sums of a and b: [a0+a1, a2+a3, b0+b1, b2+b3, a4+a5, a6+a7, b4+b5, b6+b7]. */
static inline v8 hadd8(v8 a, v8 b) {
    return SHUF(a, b, 0, 2, 8, 10, 4, 6, 12, 14) + SHUF(a, b, 1, 3, 9, 11, 5, 7, 13, 15);
}

/* r[j] = the sum of x[j]'s lanes: eight horizontal sums for the price of about two. */
static inline v8 reduce8(const v8 *x) {
    const v8 lo = hadd8(hadd8(x[0], x[1]), hadd8(x[2], x[3]));
    const v8 hi = hadd8(hadd8(x[4], x[5]), hadd8(x[6], x[7]));
    return SHUF(lo, hi, 0, 1, 2, 3, 8, 9, 10, 11) + SHUF(lo, hi, 4, 5, 6, 7, 12, 13, 14, 15);
}

/* s[h * stride] = scale * <q[h], k + koff[h]> for the hq heads of one token (koff[h] =
 * (h / group) * D, worked out once per call: a division per head and token cost more than
 * the dot products), D a compile-time head size (a multiple of 16). Each dot product is
 * one chain of fused multiply-adds over sixteen lanes; heads go eight at a time (the last
 * eight padded with zeros) and their lane sums are reduced together: one dot at a time is
 * bound by its own horizontal sum. Every head is summed the same way, whatever hq. */
#define DEFINE_TOKEN_SCORES(D)                                                               \
    static void token_scores_##D(float *s, int64_t stride, const float *q, const float *k,   \
                                 int64_t hq, const int64_t *koff, float scale) {             \
        for (int64_t h0 = 0; h0 < hq; h0 += 8) {                                             \
            const int64_t nh = hq - h0 < 8 ? hq - h0 : 8;                                    \
            v8 acc[8];                                                                       \
            _Pragma("GCC unroll 8") for (int j = 0; j < 8; j++) {                            \
                acc[j] = (v8){0};                                                            \
                if (j >= nh) continue;                                                       \
                const float *qh = q + (h0 + j) * D, *kh = k + koff[h0 + j];                  \
                v16 a = load16(qh) * load16(kh);                                             \
                _Pragma("GCC unroll 8") for (int c = 16; c < D; c += 16)                     \
                    a = fma16(load16(qh + c), load16(kh + c), a);                            \
                acc[j] = lo8(a) + hi8(a);                                                    \
            }                                                                                \
            const v8 r = reduce8(acc) * scale;                                               \
            for (int64_t j = 0; j < nh; j++) s[(h0 + j) * stride] = r[j];                    \
        }                                                                                    \
    }

/* o[h] = sum_t p[h, t] * (token t's V at koff[h]), fused, for nh heads from h0 (nh and D
 * constants where inlined), their sums in registers: each token's V row is read once for
 * all of them. */
static inline __attribute__((always_inline)) void weighted_v_heads(
    float *o, const float *p, const float *const *vrows, int64_t len, const int64_t *koff,
    int64_t h0, const int nh, const int D) {
    v16 acc[6][8];
#pragma GCC unroll 6
    for (int j = 0; j < nh; j++)
#pragma GCC unroll 8
        for (int c = 0; c < D / 16; c++) acc[j][c] = (v16){0};
    for (int64_t t = 0; t < len; t++) {
        const float *v = vrows[t];
#pragma GCC unroll 6
        for (int j = 0; j < nh; j++) {
            const v16 w = (v16){0} + p[(h0 + j) * len + t];
#pragma GCC unroll 8
            for (int c = 0; c < D / 16; c++)
                acc[j][c] = fma16(w, load16(v + koff[h0 + j] + 16 * c), acc[j][c]);
        }
    }
#pragma GCC unroll 6
    for (int j = 0; j < nh; j++) memcpy(o + (h0 + j) * D, acc[j], sizeof(float) * D);
}

/* Pass 2 at head size D: heads in chunks of up to 24 / (D / 16) (the sums of a chunk fill
 * 24 vector registers). */
#define WV_CASE(N, D)                                                                         \
    case N: weighted_v_heads(o, p, vrows, len, koff, h0, N, D); break
#define DEFINE_WEIGHTED_V(D)                                                                 \
    static void weighted_v_##D(float *o, const float *p, const float *const *vrows,          \
                               int64_t len, int64_t hq, const int64_t *koff) {               \
        const int64_t chunk = 24 / (D / 16);                                                 \
        for (int64_t h0 = 0; h0 < hq; h0 += chunk) {                                         \
            switch (hq - h0 < chunk ? hq - h0 : chunk) {                                     \
                WV_CASE(1, D); WV_CASE(2, D); WV_CASE(3, D);                                 \
                WV_CASE(4, D); WV_CASE(5, D); WV_CASE(6, D);                                 \
            }                                                                                \
        }                                                                                    \
    }

DEFINE_TOKEN_SCORES(64)
DEFINE_TOKEN_SCORES(128)
DEFINE_WEIGHTED_V(64)
DEFINE_WEIGHTED_V(128)

static void token_scores(float *s, int64_t stride, const float *q, const float *k, int64_t hq,
                         const int64_t *koff, int64_t d, float scale) {
    if (d == 64) token_scores_64(s, stride, q, k, hq, koff, scale);
    else if (d == 128) token_scores_128(s, stride, q, k, hq, koff, scale);
    else
        for (int64_t h = 0; h < hq; h++) s[h * stride] = dot(q + h * d, k + koff[h], d) * scale;
}

static void weighted_v(float *o, const float *p, const float *const *vrows, int64_t len,
                       int64_t hq, const int64_t *koff, int64_t d) {
    if (d == 64) return weighted_v_64(o, p, vrows, len, hq, koff);
    if (d == 128) return weighted_v_128(o, p, vrows, len, hq, koff);
    memset(o, 0, sizeof(float) * (size_t)(hq * d));
    for (int64_t t = 0; t < len; t++)
        for (int64_t h = 0; h < hq; h++) axpy(o + h * d, p[h * len + t], vrows[t] + koff[h], d);
}

/* In-place softmax of s[0:n] (VW partial maxima and sums so the loops vectorize). */
static void softmax(float *s, int64_t n) {
    float mx[VW], acc[VW] = {0};
    for (int j = 0; j < VW; j++) mx[j] = -INFINITY;
    int64_t t = 0;
    for (; t + VW <= n; t += VW)
        for (int j = 0; j < VW; j++) mx[j] = s[t + j] > mx[j] ? s[t + j] : mx[j];
    float m = -INFINITY;
    for (; t < n; t++) m = s[t] > m ? s[t] : m;
    for (int j = 0; j < VW; j++) m = mx[j] > m ? mx[j] : m;
    for (t = 0; t + VW <= n; t += VW)
        for (int j = 0; j < VW; j++) {
            s[t + j] = exp_approx(s[t + j] - m);
            acc[j] += s[t + j];
        }
    float sum = 0.f;
    for (; t < n; t++) {
        s[t] = exp_approx(s[t] - m);
        sum += s[t];
    }
    const float inv = 1.f / (sum + hsum(acc));
    for (t = 0; t < n; t++) s[t] *= inv;
}

/* Attention of single query rows over the paged cache [num_blocks, bs, hkv, d], reading
 * K/V in place. Query i of this call is row rows[i] of q/out ([T, hq, d]); it attends to
 * positions 0 .. lens[i] - 1 of the sequence whose block table is tables + seqs[i] *
 * table_stride (a decode row: its whole context; a prefill row: its causal prefix). Pass 1
 * streams K token-major once, scoring eight heads at a time, while the same tokens' V is
 * prefetched; pass 2 sums V weighted by the softmax, a chunk of heads per read of V, from
 * cache, with the output in registers. Returns 0, or -1 if scratch memory could not be
 * allocated. */
int epd_decode_attention(float *out, const float *q, const float *kc, const float *vc,
                         const int32_t *tables, int64_t table_stride, const int32_t *lens,
                         const int64_t *rows, const int64_t *seqs, int64_t n, int64_t hq,
                         int64_t hkv, int64_t d, int64_t bs, float scale) {
    int64_t maxlen = 1;
    for (int64_t i = 0; i < n; i++)
        if (lens[i] > maxlen) maxlen = lens[i];
    float *scores = malloc(sizeof(float) * (size_t)(hq * maxlen));
    const float **vrows = malloc(sizeof(float *) * (size_t)maxlen);
    int64_t *koff = malloc(sizeof(int64_t) * (size_t)hq);
    if (!scores || !vrows || !koff) {
        free(scores);
        free(vrows);
        free(koff);
        return -1;
    }
    const int64_t group = hq / hkv, tok = hkv * d;
    for (int64_t h = 0; h < hq; h++) koff[h] = (h / group) * d;
    for (int64_t i = 0; i < n; i++) {
        const int32_t *table = tables + seqs[i] * table_stride;
        const int64_t len = lens[i];
        const float *qr = q + rows[i] * hq * d, *k = kc;
        for (int64_t t = 0; t < len; t++) {
            if (t % bs == 0) {
                k = kc + (int64_t)table[t / bs] * bs * tok;
                vrows[t] = vc + (int64_t)table[t / bs] * bs * tok;
            } else {
                vrows[t] = vrows[t - 1] + tok;
            }
            /* Pull this token's V row in while K is scored: the second pass finds it in
             * cache (a sequence's V is a few hundred KB at most, well inside L2). */
            for (int64_t e = 0; e < tok; e += 16) __builtin_prefetch(vrows[t] + e, 0, 3);
            /* And the K row one block ahead: blocks are scattered, so the hardware
             * prefetcher cannot run ahead across a block boundary. */
            if (t + bs < len) {
                const float *kn = kc + ((int64_t)table[t / bs + 1] * bs + t % bs) * tok;
                for (int64_t e = 0; e < tok; e += 16) __builtin_prefetch(kn + e, 0, 3);
            }
            token_scores(scores + t, len, qr, k, hq, koff, d, scale);
            k += tok;
        }
        for (int64_t h = 0; h < hq; h++) softmax(scores + h * len, len);
        weighted_v(out + rows[i] * hq * d, scores, vrows, len, hq, koff, d);
    }
    free(koff);
    free(vrows);
    free(scores);
    return 0;
}
