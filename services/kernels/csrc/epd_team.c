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

/* y[m, :n] = x[m, :k] @ wt (+ bias) by a team. One thread: epd_gemv_t (several rows: its
 * register-blocked kernel, epd_gemv_rows.c). Several: thread t
 * streams its own run of wt's k rows into a partial output, then sums every partial over
 * its own slice of the columns. Splitting the rows keeps each thread's read long and
 * sequential (a column split cuts every row into short pieces: no faster than one
 * thread); the sum's order depends on the team's size, so results do too, in the last
 * bits. */
int64_t epd_gemv_team(float *y, const float *x, const float *wt, const float *bias,
                         int64_t m, int64_t k, int64_t n, const team_t *tm, int64_t tid,
                         int64_t nt) {
    if (nt == 1) {
        epd_gemv_t(y, n, x, wt, n, bias, m, k, n);
        return 0;
    }
    const int64_t lo = k * tid / nt, hi = k * (tid + 1) / nt;
    float *part = tm->part + tid * tm->part_stride, *xs = tm->xs + tid * tm->xs_stride;
    for (int64_t r = 0; r < m; r++)
        memcpy(xs + r * (hi - lo), x + r * k + lo, sizeof(float) * (size_t)(hi - lo));
    epd_gemv_t(part, n, xs, wt + lo * n, n, NULL, m, hi - lo, n);
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
