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

/* s[h * stride] = scale * <q[h], k[h / group]> for the hq heads of one token, D a
 * compile-time head size. Heads go eight at a time and their lane sums are reduced
 * together: one dot at a time is bound by its own horizontal sum. */
#define DEFINE_TOKEN_SCORES(D)                                                               \
    static void token_scores_##D(float *s, int64_t stride, const float *q, const float *k,   \
                                 int64_t hq, int64_t group, float scale) {                   \
        int64_t h0 = 0;                                                                      \
        for (; h0 + 8 <= hq; h0 += 8) {                                                      \
            v8 acc[8];                                                                       \
            for (int j = 0; j < 8; j++) {                                                    \
                const float *qh = q + (h0 + j) * D, *kh = k + ((h0 + j) / group) * D;        \
                v8 a = load8(qh) * load8(kh), b = load8(qh + 8) * load8(kh + 8);             \
                for (int c = 16; c < D; c += 16) {                                           \
                    a += load8(qh + c) * load8(kh + c);                                      \
                    b += load8(qh + c + 8) * load8(kh + c + 8);                              \
                }                                                                            \
                acc[j] = a + b;                                                              \
            }                                                                                \
            const v8 r = reduce8(acc) * scale;                                               \
            for (int j = 0; j < 8; j++) s[(h0 + j) * stride] = r[j];                         \
        }                                                                                    \
        for (; h0 < hq; h0++) {                                                              \
            const float *qh = q + h0 * D, *kh = k + (h0 / group) * D;                        \
            v8 a = load8(qh) * load8(kh);                                                    \
            for (int c = 8; c < D; c += 8) a += load8(qh + c) * load8(kh + c);               \
            float sum = 0.f;                                                                 \
            for (int j = 0; j < 8; j++) sum += a[j];                                         \
            s[h0 * stride] = sum * scale;                                                    \
        }                                                                                    \
    }

/* o[h] = sum_t p[h, t] * v_t[h / group], head by head, o[h] held in registers. */
#define DEFINE_WEIGHTED_V(D)                                                                 \
    static void weighted_v_##D(float *o, const float *p, const float *const *vrows,          \
                               int64_t len, int64_t hq, int64_t group) {                     \
        for (int64_t h = 0; h < hq; h++) {                                                   \
            v8 acc[D / 8] = {0};                                                             \
            const float *ph = p + h * len;                                                   \
            const int64_t off = (h / group) * D;                                             \
            for (int64_t t = 0; t < len; t++) {                                              \
                const float *v = vrows[t] + off;                                             \
                _Pragma("GCC unroll 16") for (int c = 0; c < D / 8; c++)                     \
                    acc[c] += ph[t] * load8(v + 8 * c);                                      \
            }                                                                                \
            memcpy(o + h * D, acc, sizeof acc);                                              \
        }                                                                                    \
    }

DEFINE_TOKEN_SCORES(64)
DEFINE_TOKEN_SCORES(128)
DEFINE_WEIGHTED_V(64)
DEFINE_WEIGHTED_V(128)

static void token_scores(float *s, int64_t stride, const float *q, const float *k, int64_t hq,
                         int64_t group, int64_t d, float scale) {
    if (d == 64) token_scores_64(s, stride, q, k, hq, group, scale);
    else if (d == 128) token_scores_128(s, stride, q, k, hq, group, scale);
    else
        for (int64_t h = 0; h < hq; h++) s[h * stride] = dot(q + h * d, k + (h / group) * d, d) * scale;
}

static void weighted_v(float *o, const float *p, const float *const *vrows, int64_t len,
                       int64_t hq, int64_t group, int64_t d) {
    if (d == 64) return weighted_v_64(o, p, vrows, len, hq, group);
    if (d == 128) return weighted_v_128(o, p, vrows, len, hq, group);
    memset(o, 0, sizeof(float) * (size_t)(hq * d));
    for (int64_t t = 0; t < len; t++)
        for (int64_t h = 0; h < hq; h++) axpy(o + h * d, p[h * len + t], vrows[t] + (h / group) * d, d);
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
 * prefetched; pass 2 sums V weighted by the softmax head by head, from cache, with the
 * output in registers. About 1.5x a plain read of the same blocks here. Returns 0, or -1
 * if scratch memory could not be allocated. */
int epd_decode_attention(float *out, const float *q, const float *kc, const float *vc,
                         const int32_t *tables, int64_t table_stride, const int32_t *lens,
                         const int64_t *rows, const int64_t *seqs, int64_t n, int64_t hq,
                         int64_t hkv, int64_t d, int64_t bs, float scale) {
    int64_t maxlen = 1;
    for (int64_t i = 0; i < n; i++)
        if (lens[i] > maxlen) maxlen = lens[i];
    float *scores = malloc(sizeof(float) * (size_t)(hq * maxlen));
    const float **vrows = malloc(sizeof(float *) * (size_t)maxlen);
    if (!scores || !vrows) {
        free(scores);
        free(vrows);
        return -1;
    }
    const int64_t group = hq / hkv, tok = hkv * d;
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
            token_scores(scores + t, len, qr, k, hq, group, d, scale);
            k += tok;
        }
        for (int64_t h = 0; h < hq; h++) softmax(scores + h * len, len);
        weighted_v(out + rows[i] * hq * d, scores, vrows, len, hq, group, d);
    }
    free(vrows);
    free(scores);
    return 0;
}

