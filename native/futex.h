/* Futex on a 32-bit word in shared memory (not FUTEX_PRIVATE: waiters and
 * wakers are different processes that map the same file). */
#ifndef STEALER_FUTEX_H
#define STEALER_FUTEX_H

#include <errno.h>
#include <linux/futex.h>
#include <stdint.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

/* Sleep while *addr == expected, at most timeout_ns (<0: forever).
 * Returns 0 when woken (or the word already differed), 1 on timeout, -errno on error. */
static inline int st_futex_wait(void *addr, uint32_t expected, int64_t timeout_ns) {
    struct timespec ts, *tsp = NULL;
    if (timeout_ns >= 0) {
        ts.tv_sec = (time_t)(timeout_ns / 1000000000LL);
        ts.tv_nsec = (long)(timeout_ns % 1000000000LL);
        tsp = &ts;
    }
    long rc = syscall(SYS_futex, (uint32_t *)addr, FUTEX_WAIT, expected, tsp, NULL, 0);
    if (rc == 0) return 0;
    if (errno == EAGAIN || errno == EINTR) return 0;
    if (errno == ETIMEDOUT) return 1;
    return -errno;
}

/* Wake up to n waiters sleeping on addr; returns how many were woken. */
static inline int st_futex_wake(void *addr, int n) {
    long rc = syscall(SYS_futex, (uint32_t *)addr, FUTEX_WAKE, n, NULL, NULL, 0);
    return rc < 0 ? 0 : (int)rc;
}

#endif
