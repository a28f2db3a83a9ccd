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

/* The vector the loops run on: on AVX-512 one register holds sixteen lanes of a dot
 * product's chain, elsewhere two do (GCC compiles sixteen-lane vectors without AVX-512
 * through the stack: ~6x slower). Lane l of a chain sums features 16c + l either way, so
 * the two builds give the same bits. ACC: the sums a pass keeps in registers; TQ: tokens
 * a block of scores takes (their sums, the queries and a key row fill the registers). */
#if defined(__AVX512F__)
#define VL 16
typedef v16 vf;
#define loadv load16
#define fmav fma16
enum { ACC = 16, TQ = 8, PAIR = 1 };
static inline v8 fold8(const vf *a) { return lo8(a[0]) + hi8(a[0]); }
#else
#define VL 8
typedef v8 vf;
#define loadv load8
#define fmav fma8
enum { ACC = 8, TQ = 4, PAIR = 0 };
static inline v8 fold8(const vf *a) { return a[0] + a[1]; }
#endif
#define PER16 (16 / VL) /* vectors per sixteen lanes */

#define TB 8 /* tokens scored per pass over a head's query: one reduce8 of their sums */
/* Tokens between a K/V row's prefetch and its use: 16-32 alike here, 8 slower. */
#define PF_AHEAD 16

/* s[j * stride + i] = scale * <q[j], krows[i] + koff> for NH query heads q[0 .. NH - 1]
 * of one KV head (at koff in a token's row) and tokens i < n <= TB (krows holds TB valid
 * pointers). The queries stay in registers over the TB tokens where they fit, and each
 * key vector is loaded once for all NH heads. A dot product is one chain of fused
 * multiply-adds over sixteen lanes, its lanes then reduced eight dot products at a time;
 * the same operations in the same order whatever else shares the pass, so a score does
 * not depend on them. Each token's slice of the K and V rows PF_AHEAD tokens on is
 * prefetched into L2 between the products: interleaved, the prefetches keep the memory
 * busy without stalling the arithmetic (a separate loop of them ran 25 % slower or
 * faster with the code's alignment). */
static inline __attribute__((always_inline)) void score_tokens(
    float *s, int64_t stride, const float *q, const float *const *krows,
    const float *const *vrows, int64_t koff, int64_t n, float scale, const int NH,
    const int D) {
    vf qv[2][D / VL];
    v8 part[2][TB];
#pragma GCC unroll 2
    for (int j = 0; j < NH; j++)
#pragma GCC unroll 16
        for (int c = 0; c < D / VL; c++) qv[j][c] = loadv(q + j * D + VL * c);
#pragma GCC unroll 2
    for (int i0 = 0; i0 < TB; i0 += TQ) {
        vf acc[2][TQ][PER16];
#pragma GCC unroll 8
        for (int i = 0; i < TQ; i++) {
            const float *k = krows[i0 + i] + koff;
#pragma GCC unroll 8
            for (int c = 0; c < D / 16; c++) {
                __builtin_prefetch(krows[i0 + i + PF_AHEAD] + koff + 16 * c, 0, 2);
                __builtin_prefetch(vrows[i0 + i + PF_AHEAD] + koff + 16 * c, 0, 2);
            }
#pragma GCC unroll 16
            for (int c = 0; c < D / VL; c++) {
                const vf kc = loadv(k + VL * c);
#pragma GCC unroll 2
                for (int j = 0; j < NH; j++)
                    acc[j][i][c % PER16] = c < PER16 ? qv[j][c] * kc
                                                     : fmav(qv[j][c], kc, acc[j][i][c % PER16]);
            }
        }
#pragma GCC unroll 2
        for (int j = 0; j < NH; j++)
#pragma GCC unroll 8
            for (int i = 0; i < TQ; i++) part[j][i0 + i] = fold8(acc[j][i]);
    }
#pragma GCC unroll 2
    for (int j = 0; j < NH; j++) {
        const v8 r = reduce8(part[j]) * scale;
        if (n == TB) memcpy(s + j * stride, &r, sizeof r);
        else memcpy(s + j * stride, &r, sizeof(float) * (size_t)n);
    }
}

/* Pulls the whole K and V rows of tokens 0 .. n - 1 toward L2 (a row's first tokens:
 * score_tokens prefetches the rest as it goes). */
static void prefetch_rows(const float *const *krows, const float *const *vrows, int64_t n,
                          int64_t tok) {
    for (int64_t i = 0; i < n; i++)
        for (int64_t e = 0; e < tok; e += 16) {
            __builtin_prefetch(krows[i] + e, 0, 2);
            __builtin_prefetch(vrows[i] + e, 0, 2);
        }
}

/* Pass 1 at head size D: every head's scores s[h * len + t], TB tokens at a time, a pair
 * of query heads per read of a key when they share a KV head, D = 64 and the registers
 * hold both (AVX-512: queries, sums and a key row then fill 28), one head at a time
 * otherwise. */
#define DEFINE_SCORES(D)                                                                     \
    static void scores_##D(float *s, int64_t len, const float *q, const float *const *krows, \
                           const float *const *vrows, int64_t hq, int64_t group,             \
                           float scale) {                                                    \
        const int pair = PAIR && D == 64 && group % 2 == 0;                                  \
        for (int64_t t = 0; t < len; t += TB) {                                              \
            const int64_t n = len - t < TB ? len - t : TB;                                   \
            for (int64_t h = 0; h < hq; h += 1 + pair) {                                     \
                float *sh = s + h * len + t;                                                 \
                const int64_t koff = (h / group) * D;                                        \
                if (pair) score_tokens(sh, len, q + h * D, krows + t, vrows + t, koff, n, scale, 2, D); \
                else score_tokens(sh, len, q + h * D, krows + t, vrows + t, koff, n, scale, 1, D); \
            }                                                                                \
        }                                                                                    \
    }

/* o[h][c0 : c0 + VL * FV] = sum_t p[h * len + t] * (token t's V row of h's KV head), fused,
 * for NK KV heads from kv0 and NG of each one's query heads from sub0: each V vector is
 * loaded once for its NG heads, and the NK * NG * FV sums (at most ACC) stay in registers.
 * A lane's sum runs over the tokens in order whatever the pass holds besides. */
static inline __attribute__((always_inline)) void weighted_v_heads(
    float *o, const float *p, const float *const *vrows, int64_t len, int64_t group,
    int64_t kv0, int64_t sub0, int64_t c0, const int NK, const int NG, const int FV,
    const int D) {
    vf acc[4][4][8];
#pragma GCC unroll 4
    for (int k = 0; k < NK; k++)
#pragma GCC unroll 4
        for (int j = 0; j < NG; j++)
#pragma GCC unroll 8
            for (int f = 0; f < FV; f++) acc[k][j][f] = (vf){0};
    for (int64_t t = 0; t < len; t++) {
#pragma GCC unroll 4
        for (int k = 0; k < NK; k++) {
            const float *v = vrows[t] + (kv0 + k) * D + c0;
            vf w[4];
#pragma GCC unroll 4
            for (int j = 0; j < NG; j++) w[j] = (vf){0} + p[((kv0 + k) * group + sub0 + j) * len + t];
#pragma GCC unroll 8
            for (int f = 0; f < FV; f++) {
                const vf vv = loadv(v + VL * f);
#pragma GCC unroll 4
                for (int j = 0; j < NG; j++) acc[k][j][f] = fmav(w[j], vv, acc[k][j][f]);
            }
        }
    }
#pragma GCC unroll 4
    for (int k = 0; k < NK; k++)
#pragma GCC unroll 4
        for (int j = 0; j < NG; j++)
            memcpy(o + ((kv0 + k) * group + sub0 + j) * D + c0, acc[k][j],
                   sizeof(float) * VL * FV);  // fmt: skip
}

/* Pass 2 at head size D, FV vectors of features a pass: whole GQA groups of several KV
 * heads per pass while their sums fit ACC registers, else each group in parts of ACC / FV
 * heads. */
#define DEFINE_WEIGHTED_V(D, FV, CASES)                                                      \
    static void weighted_v_##D(float *o, const float *p, const float *const *vrows,          \
                               int64_t len, int64_t hq, int64_t hkv) {                       \
        const int64_t group = hq / hkv, whole = group * FV <= ACC;                           \
        const int64_t nk = whole ? ACC / (group * FV) : 1, ng = whole ? group : ACC / FV;    \
        for (int64_t kv0 = 0; kv0 < hkv; kv0 += nk)                                          \
            for (int64_t sub0 = 0; sub0 < group; sub0 += ng)                                 \
                for (int64_t c0 = 0; c0 < D; c0 += VL * FV) {                                \
                    const int64_t k = hkv - kv0 < nk ? hkv - kv0 : nk;                       \
                    const int64_t j = group - sub0 < ng ? group - sub0 : ng;                 \
                    switch (k * 8 + j) { CASES }                                             \
                }                                                                            \
    }
#define C(NK, NG, FV, D)                                                                     \
    case NK * 8 + NG: weighted_v_heads(o, p, vrows, len, group, kv0, sub0, c0, NK, NG, FV, D); break;
DEFINE_SCORES(64)
DEFINE_SCORES(128)
#if VL == 16 /* sixteen lanes: every feature of a head at D = 64 in 4 registers, 128 in 8 */
DEFINE_WEIGHTED_V(64, 4, C(1, 1, 4, 64) C(2, 1, 4, 64) C(3, 1, 4, 64) C(4, 1, 4, 64)
                         C(1, 2, 4, 64) C(2, 2, 4, 64) C(1, 3, 4, 64) C(1, 4, 4, 64))
DEFINE_WEIGHTED_V(128, 8, C(1, 1, 8, 128) C(2, 1, 8, 128) C(1, 2, 8, 128))
#else /* eight lanes: 32 features of a head a pass, in 4 registers */
DEFINE_WEIGHTED_V(64, 4, C(1, 1, 4, 64) C(2, 1, 4, 64) C(1, 2, 4, 64))
DEFINE_WEIGHTED_V(128, 4, C(1, 1, 4, 128) C(2, 1, 4, 128) C(1, 2, 4, 128))
#endif
#undef C

/* In-place softmax of s[0:n] (VW partial maxima and sums so the loops vectorize). */
void epd_softmax(float *s, int64_t n) {
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

/* Any head size: one dot product and one axpy at a time (the shapes above are the ones
 * models use; this keeps the kernel complete). */
static void generic_row(float *o, float *s, const float *q, const float *const *krows,
                        const float *const *vrows, int64_t len, int64_t hq, int64_t group,
                        int64_t d, float scale) {
    for (int64_t t = 0; t < len; t++)
        for (int64_t h = 0; h < hq; h++)
            s[h * len + t] = dot(q + h * d, krows[t] + (h / group) * d, d) * scale;
    for (int64_t h = 0; h < hq; h++) epd_softmax(s + h * len, len);
    memset(o, 0, sizeof(float) * (size_t)(hq * d));
    for (int64_t t = 0; t < len; t++)
        for (int64_t h = 0; h < hq; h++) axpy(o + h * d, s[h * len + t], vrows[t] + (h / group) * d, d);
}

/* Attention of single query rows over the paged cache [num_blocks, bs, hkv, d], reading
 * K/V in place. Query i of this call is row rows[i] of q/out ([T, hq, d]); it attends to
 * positions 0 .. lens[i] - 1 of the sequence whose block table is tables + seqs[i] *
 * table_stride (a decode row: its whole context; a prefill row: its causal prefix). Pass 1
 * streams K once, TB tokens at a time, while the V rows of the same tokens are
 * prefetched; then each head's softmax; pass 2 sums V weighted by it, from cache, with
 * the outputs of a group of heads in registers. Returns 0, or -1 if scratch memory could
 * not be allocated. */
int epd_decode_attention(float *out, const float *q, const float *kc, const float *vc,
                         const int32_t *tables, int64_t table_stride, const int32_t *lens,
                         const int64_t *rows, const int64_t *seqs, int64_t n, int64_t hq,
                         int64_t hkv, int64_t d, int64_t bs, float scale) {
    int64_t maxlen = 1;
    for (int64_t i = 0; i < n; i++)
        if (lens[i] > maxlen) maxlen = lens[i];
    float *scores = malloc(sizeof(float) * (size_t)(hq * maxlen));
    /* krows / vrows: a row's token pointers, then TB + PF_AHEAD copies of the last for a
     * short pass and for the prefetches past the end */
    const float **krows = malloc(sizeof(float *) * (size_t)(2 * (maxlen + TB + PF_AHEAD)));
    if (!scores || !krows) {
        free(scores);
        free(krows);
        return -1;
    }
    const float **vrows = krows + maxlen + TB + PF_AHEAD;
    const int64_t group = hq / hkv, tok = hkv * d;
    for (int64_t i = 0; i < n; i++) {
        const int32_t *table = tables + seqs[i] * table_stride;
        const int64_t len = lens[i];
        const float *qr = q + rows[i] * hq * d;
        float *o = out + rows[i] * hq * d;
        if (len < 1) { /* attends to nothing: no row the backend plans */
            memset(o, 0, sizeof(float) * (size_t)(hq * d));
            continue;
        }
        for (int64_t t = 0; t < len; t++) {
            const int64_t off = ((int64_t)table[t / bs] * bs + t % bs) * tok;
            krows[t] = kc + off, vrows[t] = vc + off;
        }
        for (int64_t t = len; t < len + TB + PF_AHEAD; t++) krows[t] = krows[len - 1], vrows[t] = vrows[len - 1];
        prefetch_rows(krows, vrows, len < PF_AHEAD ? len : PF_AHEAD, tok);
        if (d == 64) {
            scores_64(scores, len, qr, krows, vrows, hq, group, scale);
            for (int64_t h = 0; h < hq; h++) epd_softmax(scores + h * len, len);
            weighted_v_64(o, scores, vrows, len, hq, hkv);
        } else if (d == 128) {
            scores_128(scores, len, qr, krows, vrows, hq, group, scale);
            for (int64_t h = 0; h < hq; h++) epd_softmax(scores + h * len, len);
            weighted_v_128(o, scores, vrows, len, hq, hkv);
        } else {
            generic_row(o, scores, qr, krows, vrows, len, hq, group, d, scale);
        }
    }
    free(krows);
    free(scores);
    return 0;
}
