/* The process-global log sink (one of the two pieces of global state the
 * style allows): a level filter, and only rank 0 prints below WARN. Also the clock. */
#include "hypertrain/base.h"

#include <stdio.h>
#include <time.h>

static ht_log_level log_level = HT_LOG_INFO;
static int log_rank = 0;

void ht_log_set_level(ht_log_level level) { log_level = level; }
void ht_log_set_rank(int rank) { log_rank = rank; }

void ht_log(ht_log_level level, const char *fmt, ...) {
    if (level < log_level) return;
    if (level < HT_LOG_WARN && log_rank != 0) return;
    static const char *tags[] = {"debug", "info", "warning", "error"};
    char line[4096];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(line, sizeof(line), fmt, ap);
    va_end(ap);
    if (log_rank != 0)
        fprintf(stderr, "[hypertrain %s rank %d] %s\n", tags[level], log_rank, line);
    else
        fprintf(stderr, "[hypertrain %s] %s\n", tags[level], line);
}

double ht_time_seconds(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}
