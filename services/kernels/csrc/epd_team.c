/* The team of threads that runs one native decode step (epd_decode.c): a barrier that
 * never hangs, and GEMVs split by weight rows across the team. */
#define _POSIX_C_SOURCE 200809L /* clock_gettime, nanosleep */
#include "epd_common.h"
#include "epd_team.h"

#include <time.h>

#define TEAM_TIMEOUT_MS 30000 /* a teammate this late is gone: fail the step, never hang */

static double seconds(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

void epd_team_fail(int64_t *sync, int64_t rc) {
    int64_t zero = 0; /* the first error wins */
    __atomic_compare_exchange_n(&sync[2], &zero, rc, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE);
}

/* Barrier of nt threads over sync = [arrived, generation, error, timeout in ms (0: the
 * default)]; returns the team's error (0 if none). Spins first (a stage ends within
 * microseconds of its neighbours'), then sleeps in short naps so that a teammate without
 * a CPU of its own can run, and gives up after the timeout. */
int64_t epd_team_sync(int64_t *sync, int64_t nt) {
    if (nt > 1) {
        const int64_t gen = __atomic_load_n(&sync[1], __ATOMIC_ACQUIRE);
        if (__atomic_add_fetch(&sync[0], 1, __ATOMIC_ACQ_REL) == nt) {
            __atomic_store_n(&sync[0], 0, __ATOMIC_RELAXED);
            __atomic_store_n(&sync[1], gen + 1, __ATOMIC_RELEASE);
        } else {
            const struct timespec nap = {0, 20000};
            const double limit = 1e-3 * (double)(sync[3] > 0 ? sync[3] : TEAM_TIMEOUT_MS);
            double t0 = 0.0;
            for (int64_t spins = 0; __atomic_load_n(&sync[1], __ATOMIC_ACQUIRE) == gen; spins++) {
                if (spins < 2000) {
#if defined(__x86_64__) || defined(__i386__)
                    __builtin_ia32_pause();
#endif
                    continue;
                }
                nanosleep(&nap, NULL);
                if (t0 == 0.0) t0 = seconds();
                else if (spins % 64 == 0 && seconds() - t0 > limit) {
                    epd_team_fail(sync, -5);
                    break;
                }
            }
        }
    }
    return __atomic_load_n(&sync[2], __ATOMIC_ACQUIRE);
}

/* epd_gemv_t for more rows (a verification's): the same sums in the same order, so bitwise
 * its results, with the columns cut in tiles. epd_gemv_t streams eight weight rows once per
 * output row: past four rows that re-read (8 x n floats, up to ~90 KB) comes from L2;
 * here a tile's slice of the eight rows (8 KB) stays in L1 while every output row uses it. */
#define GEMV_TILE 256
static void gemv_rows(float *y, int64_t ldy, const float *x, const float *wt, int64_t ldw,
                      const float *bias, int64_t m, int64_t k, int64_t n) {
    if (m <= 4) {
        epd_gemv_t(y, ldy, x, wt, ldw, bias, m, k, n);
        return;
    }
    for (int64_t r = 0; r < m; r++) {
        if (bias) memcpy(y + r * ldy, bias, sizeof(float) * (size_t)n);
        else memset(y + r * ldy, 0, sizeof(float) * (size_t)n);
    }
    const int64_t g = k / 8, gs = g * ldw;
    for (int64_t i = 0; i < g; i++) {
        const float *w0 = wt + i * ldw, *w1 = w0 + gs, *w2 = w1 + gs, *w3 = w2 + gs;
        const float *w4 = w3 + gs, *w5 = w4 + gs, *w6 = w5 + gs, *w7 = w6 + gs;
        for (int64_t j0 = 0; j0 < n; j0 += GEMV_TILE) {
            const int64_t j1 = j0 + GEMV_TILE < n ? j0 + GEMV_TILE : n;
            for (int64_t r = 0; r < m; r++) {
                const float *a = x + r * k + i;
                const float a0 = a[0], a1 = a[g], a2 = a[2 * g], a3 = a[3 * g];
                const float a4 = a[4 * g], a5 = a[5 * g], a6 = a[6 * g], a7 = a[7 * g];
                float *yr = y + r * ldy;
                for (int64_t j = j0; j < j1; j++)
                    yr[j] += a0 * w0[j] + a1 * w1[j] + a2 * w2[j] + a3 * w3[j] + a4 * w4[j] +
                             a5 * w5[j] + a6 * w6[j] + a7 * w7[j];
            }
        }
    }
    for (int64_t kk = 8 * g; kk < k; kk++)
        for (int64_t r = 0; r < m; r++) axpy(y + r * ldy, x[r * k + kk], wt + kk * ldw, n);
}


/* y[m, :n] = x[m, :k] @ wt (+ bias) by a team. One thread: epd_gemv_t. Several: thread t
 * streams its own run of wt's k rows into a partial output, then sums every partial over
 * its own slice of the columns. Splitting the rows keeps each thread's read long and
 * sequential (a column split cuts every row into short pieces: no faster than one
 * thread); the sum's order depends on the team's size, so results do too, in the last
 * bits. */
int64_t epd_gemv_team(float *y, const float *x, const float *wt, const float *bias,
                         int64_t m, int64_t k, int64_t n, const team_t *tm, int64_t tid,
                         int64_t nt) {
    if (nt == 1) {
        gemv_rows(y, n, x, wt, n, bias, m, k, n);
        return 0;
    }
    const int64_t lo = k * tid / nt, hi = k * (tid + 1) / nt;
    float *part = tm->part + tid * tm->part_stride, *xs = tm->xs + tid * tm->xs_stride;
    for (int64_t r = 0; r < m; r++)
        memcpy(xs + r * (hi - lo), x + r * k + lo, sizeof(float) * (size_t)(hi - lo));
    gemv_rows(part, n, xs, wt + lo * n, n, NULL, m, hi - lo, n);
    const int64_t err = epd_team_sync(tm->sync, nt);
    if (err) return err;
    const int64_t chunk = ((n + nt - 1) / nt + 15) / 16 * 16;
    const int64_t c0 = tid * chunk < n ? tid * chunk : n, c1 = c0 + chunk < n ? c0 + chunk : n;
    for (int64_t r = 0; r < m; r++) {
        float *yr = y + r * n;
        for (int64_t j = c0; j < c1; j++) yr[j] = bias ? bias[j] : 0.f;
        for (int64_t t = 0; t < nt; t++) {
            const float *pr = tm->part + t * tm->part_stride + r * n;
            for (int64_t j = c0; j < c1; j++) yr[j] += pr[j];
        }
    }
    return 0;
}
