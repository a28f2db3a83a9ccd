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
 * (s[i][j]: key i, query j), so a key's features are broadcast against eight queries per
 * vector, the softmax's maxima and sums run down columns (vertical, vectorized), and
 * P.V broadcasts s[i][j] against V rows as they lie in the cache. */
#include "epd_common.h"

#if defined(__x86_64__) && defined(__AVX__)
#define KEEP_IN_REGISTER(v) __asm__("" : "+x"(v))
#else
#define KEEP_IN_REGISTER(v) (void)0
#endif

#define XT_ROWS 32 /* query vectors per unit: positions x GQA group */
#define XT_KEYS 64 /* keys per online-softmax step (four blocks of 16) */


static inline void store8(float *p, v8 v) { memcpy(p, &v, sizeof v); }

/* s[i][j] = <qt[:, j], krow[i]> for keys i < nt and queries j < 8 * nv (row stride w), four
 * keys by two vectors of queries at a time: eight accumulators, within AVX2's 16 registers
 * with room for the loads. */
static void tile_scores(float *s, int64_t w, const float *qt, const float *const *krow,
                        int64_t nt, int64_t d, int64_t nv, const float *const *pf, int64_t npf) {
    int64_t i = 0;
    for (; i + 4 <= nt; i += 4) {
        /* Pull the next step's rows toward L2, a few per group of keys: spread out, the
         * prefetches never fill the miss buffers at once. */
        for (int64_t r = 2 * i; r < 2 * i + 8 && r < npf; r++)
            for (int64_t c = 0; c < d; c += 16) __builtin_prefetch(pf[r] + c, 0, 1);
        const float *k0 = krow[i], *k1 = krow[i + 1], *k2 = krow[i + 2], *k3 = krow[i + 3];
        int64_t v = 0;
        for (; v + 2 <= nv; v += 2) {
            v8 a0 = {0}, a1 = {0}, b0 = {0}, b1 = {0}, c0 = {0}, c1 = {0}, e0 = {0}, e1 = {0};
            for (int64_t c = 0; c < d; c++) {
                v8 x = load8(qt + c * w + 8 * v), y = load8(qt + c * w + 8 * v + 8);
                /* Keep x and y in registers: folded into each FMA as a memory operand (what
                 * GCC does unasked) they cost eight loads instead of two. */
                KEEP_IN_REGISTER(x);
                KEEP_IN_REGISTER(y);
                v8 kk = splat8(k0[c]);
                a0 = fma8(kk, x, a0), a1 = fma8(kk, y, a1);
                kk = splat8(k1[c]);
                b0 = fma8(kk, x, b0), b1 = fma8(kk, y, b1);
                kk = splat8(k2[c]);
                c0 = fma8(kk, x, c0), c1 = fma8(kk, y, c1);
                kk = splat8(k3[c]);
                e0 = fma8(kk, x, e0), e1 = fma8(kk, y, e1);
            }
            float *o = s + i * w + 8 * v;
            store8(o, a0), store8(o + 8, a1), store8(o + w, b0), store8(o + w + 8, b1);
            store8(o + 2 * w, c0), store8(o + 2 * w + 8, c1);
            store8(o + 3 * w, e0), store8(o + 3 * w + 8, e1);
        }
        for (; v < nv; v++) {
            v8 a = {0}, b = {0}, c_ = {0}, e = {0};
            for (int64_t c = 0; c < d; c++) {
                v8 x = load8(qt + c * w + 8 * v);
                KEEP_IN_REGISTER(x);
                a = fma8(splat8(k0[c]), x, a), b = fma8(splat8(k1[c]), x, b);
                c_ = fma8(splat8(k2[c]), x, c_), e = fma8(splat8(k3[c]), x, e);
            }
            float *o = s + i * w + 8 * v;
            store8(o, a), store8(o + w, b), store8(o + 2 * w, c_), store8(o + 3 * w, e);
        }
    }
    for (; i < nt; i++)
        for (int64_t v = 0; v < nv; v++) {
            v8 a = {0};
            for (int64_t c = 0; c < d; c++) a = fma8(splat8(krow[i][c]), load8(qt + c * w + 8 * v), a);
            store8(s + i * w + 8 * v, a);
        }
}

/* o[j][:] += sum_i p[i][j] * vrow[i][:] for queries j < w (a multiple of 8) and keys i < nt:
 * four queries by sixteen features at a time, eight accumulators. d % 16 == 0. */
static void tile_pv(float *o, const float *p, int64_t w, const float *const *vrow, int64_t nt,
                    int64_t d) {
    /* Features outermost: the 16 features of all nt V rows (4 KB) stay in L1 while every
     * group of four queries reads them. */
    for (int64_t c = 0; c < d; c += 16)
        for (int64_t j = 0; j < w; j += 4) {
            float *o0 = o + j * d + c, *o1 = o0 + d, *o2 = o1 + d, *o3 = o2 + d;
            v8 a0 = load8(o0), a1 = load8(o0 + 8), b0 = load8(o1), b1 = load8(o1 + 8);
            v8 c0 = load8(o2), c1 = load8(o2 + 8), e0 = load8(o3), e1 = load8(o3 + 8);
            for (int64_t i = 0; i < nt; i++) {
                const v8 x = load8(vrow[i] + c), y = load8(vrow[i] + c + 8);
                const float *pi = p + i * w + j;
                v8 pp = splat8(pi[0]);
                a0 = fma8(pp, x, a0), a1 = fma8(pp, y, a1);
                pp = splat8(pi[1]);
                b0 = fma8(pp, x, b0), b1 = fma8(pp, y, b1);
                pp = splat8(pi[2]);
                c0 = fma8(pp, x, c0), c1 = fma8(pp, y, c1);
                pp = splat8(pi[3]);
                e0 = fma8(pp, x, e0), e1 = fma8(pp, y, e1);
            }
            store8(o0, a0), store8(o0 + 8, a1), store8(o1, b0), store8(o1 + 8, b1);
            store8(o2, c0), store8(o2 + 8, c1), store8(o3, e0), store8(o3 + 8, e1);
        }
}

/* One online-softmax step over keys t0 .. t0 + nt - 1, eight queries per vector: mask keys
 * past each query's own position (lim[j]), turn s into exp(s - new max), rescale the
 * running sum l and output o by exp(old max - new max). Query j's first step holds key 0,
 * so its max is finite from then on and a masked key gives exactly 0. */
static void tile_softmax(float *s, float *o, float *mx, float *l, const int32_t *lim,
                         int64_t t0, int64_t nt, int64_t w, int64_t d) {
    const v8 ninf = splat8(-INFINITY);
    for (int64_t v = 0; v < w; v += 8) {
        const v8i lv = *(const v8i *)(lim + v);
        v8 mnew = load8(mx + v), sum = {0};
        for (int64_t i = 0; i < nt; i++) {
            v8 x = load8(s + i * w + v);
            if (t0 + i > lim[v]) x = select8((v8i){0} + (int32_t)(t0 + i) > lv, ninf, x);
            store8(s + i * w + v, x);
            mnew = max8(mnew, x);
        }
        for (int64_t i = 0; i < nt; i++) {
            const v8 x = load8(s + i * w + v);
            const v8 p = select8(x == ninf, (v8){0}, exp8(x - mnew));
            store8(s + i * w + v, p);
            sum += p;
        }
        const v8 alpha = exp8(load8(mx + v) - mnew); /* ~0 on the first step: l = o = 0 */
        store8(l + v, load8(l + v) * alpha + sum);
        store8(mx + v, mnew);
        if (t0 == 0) continue;
        for (int64_t j = v; j < v + 8; j++)
            if (alpha[j - v] != 1.f)
                for (int64_t c = 0; c < d; c += 8) store8(o + j * d + c, load8(o + j * d + c) * alpha[j - v]);
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
    const int64_t nq = m * g, nv = (nq + 7) / 8, w = 8 * nv, tok = a->hkv * d;
    const int32_t *table = a->tables + u[0] * a->table_stride;
    float *qt = scratch, *o = qt + d * w, *s = o + w * d;
    float mx[XT_ROWS], l[XT_ROWS];
    int32_t lim[XT_ROWS] __attribute__((aligned(32)));
    const float *krow[XT_KEYS], *vrow[XT_KEYS], *pf[2 * XT_KEYS];
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
        /* The next step's K/V rows, prefetched while this step is scored: a unit's rows
         * are short runs scattered over blocks, which the hardware prefetcher does not
         * follow, and a long context lives in L3. */
        const int64_t nn = len - t0 - nt < XT_KEYS ? len - t0 - nt : XT_KEYS;
        for (int64_t i = 0; i < nn; i++) {
            const int64_t t = t0 + nt + i;
            const int64_t off = ((int64_t)table[t / a->bs] * a->bs + t % a->bs) * tok + kvh * d;
            pf[2 * i] = a->kc + off, pf[2 * i + 1] = a->vc + off;
        }
        tile_scores(s, w, qt, krow, nt, d, nv, pf, 2 * nn);
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
