/* Native CPU kernels of the "cpu" backend (services/kernels/cpu_backend.py).
 *
 * Plain C, fp32 only, one thread per call (the Python side splits work across threads;
 * ctypes releases the GIL). Built on first use with the system C compiler and
 * -O3 -march=native; loops are written so the compiler vectorizes them without
 * -ffast-math: reductions keep VW independent partial sums, so results are
 * deterministic for a given build. Contracts are those of the torch reference ops in
 * services/kernels/torch_backend.py.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define VW 8 /* partial sums per reduction (8 beat 4 and 16 on the attention here) */

/* Sum of VW partial sums as a tree (vectorizes; a serial chain would cost ~VW adds of
 * latency for every short dot product). */
static inline float hsum(float *acc) {
    for (int w = VW / 2; w > 0; w /= 2)
        for (int j = 0; j < w; j++) acc[j] += acc[j + w];
    return acc[0];
}

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

static inline void axpy(float *y, float a, const float *x, int64_t n) {
    for (int64_t i = 0; i < n; i++) y[i] += a * x[i];
}

/* ---- attention ------------------------------------------------------------------- */

/* Eight floats as one value (GCC/Clang vector extension: AVX on x86, NEON pairs on Arm). */
typedef float v8 __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));
#if defined(__clang__)
#define SHUF(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define SHUF(a, b, ...) __builtin_shuffle(a, b, (v8i){__VA_ARGS__})
#endif

static inline v8 load8(const float *p) {
    v8 v;
    memcpy(&v, p, sizeof v);
    return v;
}

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
        for (; h0 < hq; h0++)                                                                \
            s[h0 * stride] = dot(q + h0 * D, k + (h0 / group) * D, D) * scale;               \
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

/* y[r, :n] = x[r, :k] @ wt[:k, :n] (+ bias) for a few rows r, wt = W^T stored row-major
 * with row stride ldw, y with row stride ldy (a thread may own a column slice of both).
 * Streams wt once, eight rows at a time, into y rows that stay in cache: the weight read
 * is purely sequential, which is what batch-1 decode (memory-bound) needs. Eight streams
 * read at ~85 % of a plain sum's bandwidth here; four reach ~70 %, sixteen less. */
void epd_gemv_t(float *y, int64_t ldy, const float *x, const float *wt, int64_t ldw,
                const float *bias, int64_t m, int64_t k, int64_t n) {
    for (int64_t r = 0; r < m; r++) {
        if (bias) memcpy(y + r * ldy, bias, sizeof(float) * (size_t)n);
        else memset(y + r * ldy, 0, sizeof(float) * (size_t)n);
    }
    int64_t kk = 0;
    for (; kk + 8 <= k; kk += 8) {
        const float *w0 = wt + kk * ldw, *w1 = w0 + ldw, *w2 = w1 + ldw, *w3 = w2 + ldw;
        const float *w4 = w3 + ldw, *w5 = w4 + ldw, *w6 = w5 + ldw, *w7 = w6 + ldw;
        for (int64_t r = 0; r < m; r++) {
            const float *a = x + r * k + kk;
            const float a0 = a[0], a1 = a[1], a2 = a[2], a3 = a[3];
            const float a4 = a[4], a5 = a[5], a6 = a[6], a7 = a[7];
            float *yr = y + r * ldy;
            for (int64_t j = 0; j < n; j++)
                yr[j] += a0 * w0[j] + a1 * w1[j] + a2 * w2[j] + a3 * w3[j] + a4 * w4[j] +
                         a5 * w5[j] + a6 * w6[j] + a7 * w7[j];
        }
    }
    for (; kk < k; kk++)
        for (int64_t r = 0; r < m; r++) axpy(y + r * ldy, x[r * k + kk], wt + kk * ldw, n);
}

/* out[m, :h] = silu(x[m, :h]) * x[m, h:2h]  (x is the fused gate/up projection). */
void epd_silu_mul(float *out, const float *x, int64_t m, int64_t h) {
    for (int64_t r = 0; r < m; r++) {
        const float *g = x + r * 2 * h, *u = g + h;
        float *o = out + r * h;
        for (int64_t i = 0; i < h; i++) o[i] = g[i] / (1.f + exp_approx(-g[i])) * u[i];
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
