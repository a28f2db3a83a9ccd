/* The int8 KV cache of the "cpu" backend (services/kernels/kv_quant.py; see epd_cpu.c for
 * how the library is built).
 *
 * A cache row, one token's vector of one KV head, is d int8 codes followed by the four
 * bytes of its fp32 scale: value j = codes[j] * scale. epd_kv_quantize writes rows with
 * the operations of kv_quant.quantize, in the same order (so the native step and the
 * torch path store the same bytes); epd_decode_attention_q8 is epd_decode_attention's
 * contract over such a cache, for head sizes divisible by 8.
 *
 * The scores and the weighted sum of V read the codes widened to fp32 eight at a time;
 * each key's scale multiplies its finished dot product, each value's scale its softmax
 * weight, so a row costs d one-byte loads where the fp32 cache costs d four-byte ones.
 * One query row at a time, each of its sums in a fixed order: a row's result does not
 * depend on its batch. */
#include "epd_common.h"

typedef int8_t v8b __attribute__((vector_size(8)));

#define ROW(d) ((d) + 4) /* bytes of a cache row */

static inline v8 widen8(const int8_t *p) {
    v8b b;
    memcpy(&b, p, sizeof b);
    return __builtin_convertvector(b, v8);
}

static inline float row_scale(const int8_t *row, int64_t d) {
    float s;
    memcpy(&s, row + d, sizeof s);
    return s;
}

/* n vectors of d floats -> n cache rows (d + 4 bytes each, written to dst). */
void epd_kv_quantize(int8_t *dst, const float *x, int64_t n, int64_t d) {
    for (int64_t i = 0; i < n; i++) {
        const float *xi = x + i * d;
        int8_t *ri = dst + i * ROW(d);
        float amax = 0.f;
        for (int64_t j = 0; j < d; j++) amax = fabsf(xi[j]) > amax ? fabsf(xi[j]) : amax;
        const float scale = amax / 127.f, div = scale > 0.f ? scale : 1.f;
        for (int64_t j = 0; j < d; j++) {
            const float c = rintf(xi[j] / div);
            ri[j] = (int8_t)(c > 127.f ? 127.f : c < -127.f ? -127.f : c);
        }
        memcpy(ri + d, &scale, sizeof scale);
    }
}

/* <q, codes> over d features: two chains of eight lanes, then their lanes summed. */
static inline float dot_q8(const float *q, const int8_t *k, int64_t d) {
    v8 a0 = {0}, a1 = {0};
    int64_t j = 0;
    for (; j + 16 <= d; j += 16) {
        a0 = fma8(load8(q + j), widen8(k + j), a0);
        a1 = fma8(load8(q + j + 8), widen8(k + j + 8), a1);
    }
    if (j < d) a0 = fma8(load8(q + j), widen8(k + j), a0);
    float lanes[8];
    const v8 a = a0 + a1;
    memcpy(lanes, &a, sizeof lanes);
    return tree_sum(lanes, 8);
}

/* o[0:d] += w * codes[0:d] */
static inline void axpy_q8(float *o, float w, const int8_t *v, int64_t d) {
    const v8 wv = splat8(w);
    for (int64_t j = 0; j < d; j += 8) {
        const v8 r = fma8(wv, widen8(v + j), load8(o + j));
        memcpy(o + j, &r, sizeof r);
    }
}

/* In-place softmax of s[0:n]. */
static void softmax_q8(float *s, int64_t n) {
    float m = -INFINITY, sum = 0.f;
    for (int64_t t = 0; t < n; t++) m = s[t] > m ? s[t] : m;
    for (int64_t t = 0; t < n; t++) {
        s[t] = exp_approx(s[t] - m);
        sum += s[t];
    }
    const float inv = 1.f / sum;
    for (int64_t t = 0; t < n; t++) s[t] *= inv;
}

/* epd_decode_attention over an int8 cache [num_blocks, bs, hkv, d + 4] bytes (d % 8 == 0):
 * query i of this call is row rows[i] of q/out ([T, hq, d]) and attends to positions
 * 0 .. lens[i] - 1 of the sequence whose table is tables + seqs[i] * table_stride. Returns
 * 0, or -1 if scratch memory could not be allocated. */
int epd_decode_attention_q8(float *out, const float *q, const int8_t *kc, const int8_t *vc,
                            const int32_t *tables, int64_t table_stride, const int32_t *lens,
                            const int64_t *rows, const int64_t *seqs, int64_t n, int64_t hq,
                            int64_t hkv, int64_t d, int64_t bs, float scale) {
    int64_t maxlen = 1;
    for (int64_t i = 0; i < n; i++)
        if (lens[i] > maxlen) maxlen = lens[i];
    float *scores = malloc(sizeof(float) * (size_t)(hq * maxlen));
    int64_t *offs = malloc(sizeof(int64_t) * (size_t)maxlen);
    if (!scores || !offs) {
        free(scores);
        free(offs);
        return -1;
    }
    const int64_t group = hq / hkv, tok = hkv * ROW(d);
    for (int64_t i = 0; i < n; i++) {
        const int32_t *table = tables + seqs[i] * table_stride;
        const int64_t len = lens[i];
        const float *qr = q + rows[i] * hq * d;
        float *o = out + rows[i] * hq * d;
        memset(o, 0, sizeof(float) * (size_t)(hq * d));
        if (len < 1) continue; /* attends to nothing: no row the backend plans */
        for (int64_t t = 0; t < len; t++) offs[t] = ((int64_t)table[t / bs] * bs + t % bs) * tok;
        for (int64_t t = 0; t < len; t++)
            for (int64_t kh = 0; kh < hkv; kh++) {
                const int8_t *k = kc + offs[t] + kh * ROW(d);
                const float ks = row_scale(k, d) * scale;
                for (int64_t h = kh * group; h < (kh + 1) * group; h++)
                    scores[h * len + t] = dot_q8(qr + h * d, k, d) * ks;
            }
        for (int64_t h = 0; h < hq; h++) softmax_q8(scores + h * len, len);
        for (int64_t t = 0; t < len; t++)
            for (int64_t kh = 0; kh < hkv; kh++) {
                const int8_t *v = vc + offs[t] + kh * ROW(d);
                const float vs = row_scale(v, d);
                for (int64_t h = kh * group; h < (kh + 1) * group; h++)
                    axpy_q8(o + h * d, scores[h * len + t] * vs, v, d);
            }
    }
    free(offs);
    free(scores);
    return 0;
}
