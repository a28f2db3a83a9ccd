/* The quantized KV caches of the "cpu" backend (services/kernels/kv_quant.py; see
 * epd_cpu.c for how the library is built).
 *
 * A cache row, one token's vector of one KV head, is d one-byte codes followed by the four
 * bytes of its fp32 scale: value j = code j's value * scale, a code being an int8 or an
 * fp8 e4m3 (fp8 below: the kernels' last argument). epd_kv_quantize writes rows with the
 * operations of kv_quant.quantize, in the same order (so the native step and the torch
 * path store the same bytes); epd_decode_attention_q8 is epd_decode_attention's contract
 * over such a cache, for head sizes divisible by 8.
 *
 * Each K or V row is widened to fp32 once (AVX2: eight codes a few instructions) and read
 * from L1 by every query head of its GQA group; a key's scale multiplies its finished dot
 * product, a value's scale its softmax weight. A row costs d + 4 bytes from memory where
 * the fp32 cache costs 4d: at long contexts a quantized cache is faster, at short ones even.
 * One query row at a time, each of its sums in a fixed order: a row's result does not
 * depend on its batch. */
#include "epd_common.h"
#if defined(__AVX2__)
#include <immintrin.h>
#endif

#define ROW(d) ((d) + 4) /* bytes of a cache row */

/* fp8 e4m3 (torch.float8_e4m3fn) code -> value, exact in fp32: a sign, 4 exponent bits
 * (bias 7) and 3 mantissa bits; exponent 0 is subnormal (m / 8 * 2^-6); 0x7f and 0xff
 * are NaN (no infinities; 448 is the largest). */
static float FP8[256];

__attribute__((constructor)) static void fill_fp8(void) {
    for (int c = 0; c < 256; c++) {
        const int e = (c >> 3) & 15, m = c & 7;
        float v = e ? ldexpf(1.f + (float)m / 8.f, e - 7) : ldexpf((float)m / 8.f, -6);
        if ((c & 127) == 127) v = NAN;
        FP8[c] = c & 128 ? -v : v;
    }
}

/* The fp8 code nearest y, ties to the even code, |y| saturated at 448: torch's conversion.
 * Below 2^-6 the codes are steps of 2^-9 (subnormal codes 0-7, then code 8 = 2^-6), so
 * the code is |y| * 512 rounded; above, a float's exponent and top three mantissa bits
 * rounded to nearest even, minus the exponent bias difference (120 << 3). */
static uint8_t fp8_code(float y) {
    if (y != y) return 127;
    const float a = fabsf(y);
    int code;
    if (a < 0x1p-6f) {
        code = (int)rintf(a * 512.f);
    } else {
        uint32_t bits;
        memcpy(&bits, &a, sizeof bits);
        bits += 0x7ffffu + ((bits >> 20) & 1u);
        code = (int)(bits >> 20) - (120 << 3);
        if (code > 126) code = 126;
    }
    return (uint8_t)(code | (signbit(y) ? 128 : 0));
}

#if defined(__AVX2__)
/* Eight fp8 codes' values without a table (a gather is slow on many CPUs): exponent and
 * mantissa bits moved to a float's (bits 20-26), which reads as the code's value times
 * 2^-120, subnormal codes included; then times 2^120 (exact) and the sign. Equals FP8[]
 * but for 0x7f / 0xff (NaN there, 480 here), which no finite input is quantized to. */
static inline __m256 fp8_values(__m128i bytes) {
    const __m256i w = _mm256_cvtepu8_epi32(bytes);
    const __m256i mag = _mm256_slli_epi32(_mm256_and_si256(w, _mm256_set1_epi32(0x7f)), 20);
    const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(w, _mm256_set1_epi32(0x80)), 24);
    const __m256 v = _mm256_mul_ps(_mm256_castsi256_ps(mag), _mm256_set1_ps(0x1p120f));
    return _mm256_or_ps(v, _mm256_castsi256_ps(sign));
}
#endif

/* codes[0:d] as floats (d % 8 == 0): each K or V row is widened once, then read by every
 * query head of its group from L1. */
static inline void widen(float *out, const uint8_t *codes, int64_t d, int fp8) {
    for (int64_t j = 0; j < d; j += 8) {
#if defined(__AVX2__)
        const __m128i b = _mm_loadl_epi64((const __m128i *)(codes + j));
        _mm256_storeu_ps(out + j, fp8 ? fp8_values(b) : _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)));
#else
        for (int64_t i = j; i < j + 8; i++)
            out[i] = fp8 ? FP8[codes[i]] : (float)(int8_t)codes[i];
#endif
    }
}

static inline float row_scale(const uint8_t *row, int64_t d) {
    float s;
    memcpy(&s, row + d, sizeof s);
    return s;
}

/* n vectors of d floats -> n cache rows (d + 4 bytes each, written to dst). */
void epd_kv_quantize(void *dst, const float *x, int64_t n, int64_t d, int fp8) {
    for (int64_t i = 0; i < n; i++) {
        const float *xi = x + i * d;
        uint8_t *ri = (uint8_t *)dst + i * ROW(d);
        float amax = 0.f;
        for (int64_t j = 0; j < d; j++) amax = fabsf(xi[j]) > amax ? fabsf(xi[j]) : amax;
        const float scale = amax / (fp8 ? 448.f : 127.f), div = scale > 0.f ? scale : 1.f;
        for (int64_t j = 0; j < d; j++) {
            if (fp8) {
                ri[j] = fp8_code(xi[j] / div);
                continue;
            }
            const float c = rintf(xi[j] / div);
            ri[j] = (uint8_t)(int8_t)(c > 127.f ? 127.f : c < -127.f ? -127.f : c);
        }
        memcpy(ri + d, &scale, sizeof scale);
    }
}

/* <q, x> over d features (d % 8 == 0): two chains of eight lanes, then their lanes. */
static inline float dot8(const float *q, const float *x, int64_t d) {
    v8 a0 = {0}, a1 = {0};
    int64_t j = 0;
    for (; j + 16 <= d; j += 16) {
        a0 = fma8(load8(q + j), load8(x + j), a0);
        a1 = fma8(load8(q + j + 8), load8(x + j + 8), a1);
    }
    if (j < d) a0 = fma8(load8(q + j), load8(x + j), a0);
    float lanes[8];
    const v8 a = a0 + a1;
    memcpy(lanes, &a, sizeof lanes);
    return tree_sum(lanes, 8);
}

/* o[0:d] += w * x[0:d] */
static inline void axpy8(float *o, float w, const float *x, int64_t d) {
    const v8 wv = splat8(w);
    for (int64_t j = 0; j < d; j += 8) {
        const v8 r = fma8(wv, load8(x + j), load8(o + j));
        memcpy(o + j, &r, sizeof r);
    }
}

/* epd_decode_attention over a quantized cache [num_blocks, bs, hkv, d + 4] bytes (d % 8 == 0):
 * query i of this call is row rows[i] of q/out ([T, hq, d]) and attends to positions
 * 0 .. lens[i] - 1 of the sequence whose table is tables + seqs[i] * table_stride. Pass 1
 * scores every head against each key row, widened once for its group; the softmax is
 * epd_decode_attention's; pass 2 sums the V rows, widened once each, weighted by the
 * softmax times the row's scale. Returns 0, or -1 if scratch memory could not be
 * allocated. */
int epd_decode_attention_q8(float *out, const float *q, const void *kcache, const void *vcache,
                            const int32_t *tables, int64_t table_stride, const int32_t *lens,
                            const int64_t *rows, const int64_t *seqs, int64_t n, int64_t hq,
                            int64_t hkv, int64_t d, int64_t bs, float scale, int fp8) {
    const uint8_t *kc = kcache, *vc = vcache;
    int64_t maxlen = 1;
    for (int64_t i = 0; i < n; i++)
        if (lens[i] > maxlen) maxlen = lens[i];
    float *scores = malloc(sizeof(float) * (size_t)(hq * maxlen + d));
    int64_t *offs = malloc(sizeof(int64_t) * (size_t)maxlen);
    if (!scores || !offs) {
        free(scores);
        free(offs);
        return -1;
    }
    float *row = scores + hq * maxlen; /* one K or V row, widened */
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
                const uint8_t *k = kc + offs[t] + kh * ROW(d);
                const float ks = row_scale(k, d) * scale;
                widen(row, k, d, fp8);
                for (int64_t h = kh * group; h < (kh + 1) * group; h++)
                    scores[h * len + t] = dot8(qr + h * d, row, d) * ks;
            }
        for (int64_t h = 0; h < hq; h++) epd_softmax(scores + h * len, len);
        for (int64_t t = 0; t < len; t++)
            for (int64_t kh = 0; kh < hkv; kh++) {
                const uint8_t *v = vc + offs[t] + kh * ROW(d);
                const float vs = row_scale(v, d);
                widen(row, v, d, fp8);
                for (int64_t h = kh * group; h < (kh + 1) * group; h++)
                    axpy8(o + h * d, scores[h * len + t] * vs, row, d);
            }
    }
    free(offs);
    free(scores);
    return 0;
}
