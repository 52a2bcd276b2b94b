/* core/error.c — the thread-local last-error buffer and message formatting helpers.
 * The core never exits or aborts on bad input: it records a message here and returns -1/NULL. */
#include <stdio.h>
#include <string.h>
#include "internal.h"

static _Thread_local char last_error[2048];

const char *uly_last_error(void) { return last_error; }
void uly_clear_error(void) { last_error[0] = 0; }

/* format into a scratch buffer first: callers may pass uly_last_error() itself as an argument */
static void set_error_v(const char *fmt, va_list ap) {
    char tmp[sizeof last_error];
    vsnprintf(tmp, sizeof tmp, fmt, ap);
    memcpy(last_error, tmp, sizeof tmp);
}

int uly_set_error(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    set_error_v(fmt, ap);
    va_end(ap);
    return -1;
}

void *uly_set_error_null(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    set_error_v(fmt, ap);
    va_end(ap);
    return NULL;
}

/* rotating buffers so several descriptions fit in one message */
static _Thread_local char desc_buf[8][160];
static _Thread_local int desc_next;
static char *next_buf(void) { return desc_buf[desc_next++ & 7]; }

const char *uly_shape_str(int ndim, const int64_t *shape) {
    char *b = next_buf();
    int n = snprintf(b, 160, "[");
    for (int d = 0; d < ndim && n < 150; d++)
        n += snprintf(b + n, 160 - n, d ? ", %lld" : "%lld", (long long)shape[d]);
    snprintf(b + n, 160 - n, "]");
    return b;
}

const char *uly_position_str(int ndim, const int64_t *shape, int64_t flat) {
    int64_t idx[ULY_MAX_DIMS];
    for (int d = ndim - 1; d >= 0; d--) {
        int64_t n = shape[d] > 0 ? shape[d] : 1;
        idx[d] = flat % n + 1;
        flat /= n;
    }
    return uly_shape_str(ndim, idx);
}

const char *uly_desc(const uly_tensor *t) {
    if (!t) return "NULL";
    char *b = next_buf();
    snprintf(b, 160, "%s%s%s", uly_dtype_name(t->dtype), uly_shape_str(t->ndim, t->shape),
             t->storage->device == ULY_DEVICE_CUDA ? "@cuda" : "");
    return b;
}

const char *uly_bytes_str(int64_t nbytes) {
    char *b = next_buf();
    double v = (double)nbytes;
    const char *unit[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB"};
    int u = 0;
    while (v >= 1024 && u < 5) { v /= 1024; u++; }
    snprintf(b, 160, u ? "%.2f %s" : "%.0f %s", v, unit[u]);
    return b;
}

int uly_tensor_describe(const uly_tensor *t, char *buf, int64_t buflen) {
    if (!buf || buflen <= 0) return uly_set_error("uly_tensor_describe: no buffer given");
    snprintf(buf, (size_t)buflen, "%s", uly_desc(t));
    return 0;
}
