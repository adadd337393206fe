/* The process-global log sink (one of the two pieces of global state the
 * style allows): a level filter, and only rank 0 prints below WARN. Also the clock. */
#include "hypertrain/base.h"

#include <stdarg.h>
#include <stdio.h>
#include <time.h>

static ht_log_level log_level = HT_LOG_INFO;
static int log_rank = 0;

void ht_log_set_level(ht_log_level level) { log_level = level; }
ht_log_level ht_log_get_level(void) { return log_level; }
void ht_log_set_rank(int rank) { log_rank = rank; }

static void log_line(ht_log_level level, const char *fmt, va_list ap) {
    static const char *tags[] = {"debug", "info", "warning", "error"};
    char line[4096];
    vsnprintf(line, sizeof(line), fmt, ap);
    if (log_rank != 0)
        fprintf(stderr, "[hypertrain %s rank %d] %s\n", tags[level], log_rank, line);
    else
        fprintf(stderr, "[hypertrain %s] %s\n", tags[level], line);
}

void ht_log(ht_log_level level, const char *fmt, ...) {
    if (level < log_level) return;
    if (level < HT_LOG_WARN && log_rank != 0) return;
    va_list ap;
    va_start(ap, fmt);
    log_line(level, fmt, ap);
    va_end(ap);
}

void ht_log_warn_once(const char *fmt, ...) {
    if (HT_LOG_WARN < log_level || log_rank != 0) return;
    va_list ap;
    va_start(ap, fmt);
    log_line(HT_LOG_WARN, fmt, ap);
    va_end(ap);
}

double ht_time_seconds(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}
