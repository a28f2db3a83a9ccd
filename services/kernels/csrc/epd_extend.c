/* Tiled paged attention of prefill/extend rows for the "cpu" backend (see epd_cpu.c for how
 * the library is built).
 *
 * epd_decode_attention takes one query row at a time and re-reads the row's whole causal
 * prefix from cache: fine for decode rows and short prompts, but a prompt of L tokens then
 * reads O(L^2) K/V, and each key serves a single query. Here a work unit is a tile of up
 * to XT_ROWS query vectors: consecutive positions of one sequence times the GQA group of
 * one KV head, which all read the same K/V. The unit streams its keys XT_KEYS at a time,
 * straight from the paged cache through the block table, with an online softmax (running
 * maximum and sum per query, FlashAttention's recurrence), so each key is read once per
 * tile and used XT_ROWS times from registers.
 *
 * Layouts keep every inner loop free of transposes and horizontal sums: the tile's queries
 * are packed once, transposed and pre-scaled (qt[c][j]); scores are kept key-major
 * (s[i][j]: key i, query j), so a key's features are broadcast against VL queries per
 * vector, the softmax's maxima and sums run down columns (vertical, vectorized), and
 * P.V broadcasts s[i][j] against V rows as they lie in the cache.
 *
 * Numerics: a query's score is one chain of fused multiply-adds over the features in
 * order, its output one over the keys in order, and the softmax steps fall every XT_KEYS
 * keys from key 0; so a query's result does not depend on the other queries of its tile,
 * nor on the vector width (VL: 16 lanes on AVX-512, 8 elsewhere). */
#include "epd_common.h"

#if defined(__x86_64__) && defined(__AVX__)
#define KEEP_IN_REGISTER(v) __asm__("" : "+x"(v))
#else
#define KEEP_IN_REGISTER(v) (void)0
#endif

#define XT_ROWS 64 /* query vectors per unit: positions x GQA group */
#define XT_KEYS 64 /* keys per online-softmax step */

/* The vector the loops run on, and register blocks that fill the register file: on
 * AVX-512 (32 registers) the scores take SK keys x SV vectors of queries per step and P.V
 * PQ queries x PF vectors of features; AVX2's 16 registers take half as many vectors. */
#if defined(__AVX512F__)
#define VL 16
typedef v16 vf;
typedef v16i vi;
#define loadv load16
#define fmav fma16
#define splatv splat16
#define selectv select16
#define maxv max16
#define expv exp16
enum { SK = 6, SV = 4, PQ = 4, PF = 4 };
#else
#define VL 8
typedef v8 vf;
typedef v8i vi;
#define loadv load8
#define fmav fma8
#define splatv splat8
#define selectv select8
#define maxv max8
#define expv exp8
enum { SK = 4, SV = 2, PQ = 4, PF = 2 };
#endif

static inline void storev(float *p, vf v) { memcpy(p, &v, sizeof v); }

/* s[i][j] = <qt[:, j], krow[i]> for keys i < nt and queries j < VL * nv (row stride w), SK
 * keys by SV vectors of queries per step, the sums in registers. */
static void tile_scores(float *s, int64_t w, const float *qt, const float *const *krow,
                        int64_t nt, int64_t d, int64_t nv) {
    for (int64_t i = 0; i < nt; i += SK) {
        const float *k[SK];
        for (int r = 0; r < SK; r++) k[r] = krow[i + r < nt ? i + r : nt - 1];
        for (int64_t v = 0; v < nv; v += SV) {
            const int64_t nu = nv - v < SV ? nv - v : SV;
            vf acc[SK][SV];
#pragma GCC unroll 8
            for (int r = 0; r < SK; r++)
#pragma GCC unroll 8
                for (int u = 0; u < SV; u++) acc[r][u] = (vf){0};
            if (nu == SV) {
                for (int64_t c = 0; c < d; c++) {
                    vf x[SV];
#pragma GCC unroll 8
                    for (int u = 0; u < SV; u++) {
                        x[u] = loadv(qt + c * w + VL * (v + u));
                        /* In registers: folded into each FMA as a memory operand (what
                         * GCC does unasked) they cost SK loads each instead of one. */
                        KEEP_IN_REGISTER(x[u]);
                    }
#pragma GCC unroll 8
                    for (int r = 0; r < SK; r++) {
                        const vf kk = splatv(k[r][c]);
#pragma GCC unroll 8
                        for (int u = 0; u < SV; u++) acc[r][u] = fmav(kk, x[u], acc[r][u]);
                    }
                }
            } else {
                for (int64_t c = 0; c < d; c++)
                    for (int r = 0; r < SK; r++)
                        for (int64_t u = 0; u < nu; u++)
                            acc[r][u] = fmav(splatv(k[r][c]), loadv(qt + c * w + VL * (v + u)),
                                             acc[r][u]);  // fmt: skip
            }
            for (int r = 0; r < SK && i + r < nt; r++)
                for (int64_t u = 0; u < nu; u++) storev(s + (i + r) * w + VL * (v + u), acc[r][u]);
        }
    }
}

/* o[j][c : c + VL * NF] += sum_i p[i][j] * vrow[i][c : c + VL * NF] for queries j < w (a
 * multiple of PQ) and keys i < nt: PQ queries by NF vectors of features per step, the
 * sums in registers. */
static inline __attribute__((always_inline)) void pv_features(
    float *o, const float *p, int64_t w, const float *const *vrow, int64_t nt, int64_t d,
    int64_t c, const int NF) {
    for (int64_t j = 0; j < w; j += PQ) {
        vf acc[PQ][PF];
#pragma GCC unroll 8
        for (int a = 0; a < PQ; a++)
#pragma GCC unroll 8
            for (int f = 0; f < NF; f++) acc[a][f] = loadv(o + (j + a) * d + c + VL * f);
        for (int64_t i = 0; i < nt; i++) {
            vf x[PF];
#pragma GCC unroll 8
            for (int f = 0; f < NF; f++) x[f] = loadv(vrow[i] + c + VL * f);
            const float *pi = p + i * w + j;
#pragma GCC unroll 8
            for (int a = 0; a < PQ; a++) {
                const vf pp = splatv(pi[a]);
#pragma GCC unroll 8
                for (int f = 0; f < NF; f++) acc[a][f] = fmav(pp, x[f], acc[a][f]);
            }
        }
#pragma GCC unroll 8
        for (int a = 0; a < PQ; a++)
#pragma GCC unroll 8
            for (int f = 0; f < NF; f++) storev(o + (j + a) * d + c + VL * f, acc[a][f]);
    }
}

/* o[j][:] += sum_i p[i][j] * vrow[i][:], PF vectors of features at a time (one at the end
 * of a head size that is not a multiple of VL * PF). Features outermost: those of all nt V
 * rows stay in L1 while every group of queries reads them. d % VL == 0. */
static void tile_pv(float *o, const float *p, int64_t w, const float *const *vrow, int64_t nt,
                    int64_t d) {
    int64_t c = 0;
    for (; c + VL * PF <= d; c += VL * PF) pv_features(o, p, w, vrow, nt, d, c, PF);
    for (; c < d; c += VL) pv_features(o, p, w, vrow, nt, d, c, 1);
}

/* One online-softmax step over keys t0 .. t0 + nt - 1, VL queries per vector: mask keys
 * past each query's own position (lim[j]), turn s into exp(s - new max), rescale the
 * running sum l and output o by exp(old max - new max). Query j's first step holds key 0,
 * so its max is finite from then on and a masked key gives exactly 0. */
static void tile_softmax(float *s, float *o, float *mx, float *l, const int32_t *lim,
                         int64_t t0, int64_t nt, int64_t w, int64_t d) {
    const vf ninf = splatv(-INFINITY);
    for (int64_t v = 0; v < w; v += VL) {
        vi lv;
        memcpy(&lv, lim + v, sizeof lv);
        vf mnew = loadv(mx + v), sum = {0};
        for (int64_t i = 0; i < nt; i++) {
            vf x = loadv(s + i * w + v);
            if (t0 + i > lim[v]) x = selectv((vi){0} + (int32_t)(t0 + i) > lv, ninf, x);
            storev(s + i * w + v, x);
            mnew = maxv(mnew, x);
        }
        for (int64_t i = 0; i < nt; i++) {
            const vf x = loadv(s + i * w + v);
            const vf p = selectv(x == ninf, (vf){0}, expv(x - mnew));
            storev(s + i * w + v, p);
            sum += p;
        }
        const vf alpha = expv(loadv(mx + v) - mnew); /* ~0 on the first step: l = o = 0 */
        storev(l + v, loadv(l + v) * alpha + sum);
        storev(mx + v, mnew);
        if (t0 == 0) continue;
        for (int64_t j = v; j < v + VL; j++)
            if (alpha[j - v] != 1.f)
                for (int64_t c = 0; c < d; c += VL) storev(o + j * d + c, loadv(o + j * d + c) * alpha[j - v]);
    }
}

typedef struct {
    const float *q, *kc, *vc;
    const int32_t *tables;
    int64_t table_stride, hq, hkv, d, bs;
    float scale;
} extend_args;

/* One unit u = (sequence, first query row, rows m, position of the first row, KV head).
 * scratch: qt [d][w], o [w][d], s [XT_KEYS][w]. */
static void extend_unit(float *out, const extend_args *a, const int64_t *u, float *scratch) {
    const int64_t g = a->hq / a->hkv, m = u[2], pos0 = u[3], kvh = u[4], d = a->d;
    const int64_t nq = m * g, nv = (nq + VL - 1) / VL, w = VL * nv, tok = a->hkv * d;
    const int32_t *table = a->tables + u[0] * a->table_stride;
    float *qt = scratch, *o = qt + d * w, *s = o + w * d;
    float mx[XT_ROWS], l[XT_ROWS];
    int32_t lim[XT_ROWS];
    const float *krow[XT_KEYS], *vrow[XT_KEYS];
    memset(qt, 0, sizeof(float) * (size_t)(d * w));
    memset(o, 0, sizeof(float) * (size_t)(w * d));
    for (int64_t j = 0; j < w; j++) {
        mx[j] = -INFINITY, l[j] = 0.f;
        lim[j] = (int32_t)(pos0 + (j < nq ? j / g : m - 1)); /* padding: never read back */
    }
    for (int64_t j = 0; j < nq; j++) {
        const float *src = a->q + ((u[1] + j / g) * a->hq + kvh * g + j % g) * d;
        for (int64_t c = 0; c < d; c++) qt[c * w + j] = src[c] * a->scale;
    }
    const int64_t len = pos0 + m;
    for (int64_t t0 = 0; t0 < len; t0 += XT_KEYS) {
        const int64_t nt = len - t0 < XT_KEYS ? len - t0 : XT_KEYS;
        for (int64_t i = 0; i < nt; i++) {
            const int64_t t = t0 + i, off = ((int64_t)table[t / a->bs] * a->bs + t % a->bs) * tok;
            krow[i] = a->kc + off + kvh * d;
            vrow[i] = a->vc + off + kvh * d;
        }
        /* The next step's K/V rows, toward L2 while this step is scored: a unit's rows are
         * short runs scattered over blocks, which the hardware prefetcher does not follow,
         * and a long context lives in L3. */
        for (int64_t t = t0 + XT_KEYS; t < t0 + 2 * XT_KEYS && t < len; t++) {
            const int64_t off = ((int64_t)table[t / a->bs] * a->bs + t % a->bs) * tok + kvh * d;
            for (int64_t c = 0; c < d; c += 16) {
                __builtin_prefetch(a->kc + off + c, 0, 2);
                __builtin_prefetch(a->vc + off + c, 0, 2);
            }
        }
        tile_scores(s, w, qt, krow, nt, d, nv);
        tile_softmax(s, o, mx, l, lim, t0, nt, w, d);
        tile_pv(o, s, w, vrow, nt, d);
    }
    for (int64_t j = 0; j < nq; j++) {
        float *dst = out + ((u[1] + j / g) * a->hq + kvh * g + j % g) * d;
        const float inv = 1.f / l[j];
        for (int64_t c = 0; c < d; c++) dst[c] = o[j * d + c] * inv;
    }
}

/* Causal attention of n units (five int64 each, see extend_unit) over the paged cache
 * [num_blocks, bs, hkv, d]. Query j of a unit is query row row0 + j / g, head kvh * g +
 * j % g of q/out ([T, hq, d]), at position pos0 + j / g of its sequence: it attends to keys
 * 0 .. that position. Needs m * g <= XT_ROWS and d % 16 == 0. Returns 0, -1 if scratch
 * memory could not be allocated, -2 for a shape it does not take. */
int epd_extend_attention(float *out, const float *q, const float *kc, const float *vc,
                         const int32_t *tables, int64_t table_stride, const int64_t *units,
                         int64_t n, int64_t hq, int64_t hkv, int64_t d, int64_t bs, float scale) {
    if (d % 16 != 0 || hkv <= 0 || hq % hkv != 0) return -2;
    for (int64_t i = 0; i < n; i++)
        if (units[5 * i + 2] < 1 || units[5 * i + 2] * (hq / hkv) > XT_ROWS) return -2;
    float *scratch = malloc(sizeof(float) * (size_t)(XT_ROWS * (2 * d + XT_KEYS)));
    if (!scratch) return -1;
    const extend_args a = {q, kc, vc, tables, table_stride, hq, hkv, d, bs, scale};
    for (int64_t i = 0; i < n; i++) extend_unit(out, &a, units + 5 * i, scratch);
    free(scratch);
    return 0;
}
