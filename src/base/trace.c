/* training.trace's recorder: the spans the layers report while a capture is
 * on (phases, collectives with their bytes, FSDP units' exchanges, kernel
 * entries), kept in memory and written as Chrome trace events. The process's
 * one capture is global state, as the log sink is: every layer reports to it
 * without being handed it, and a span outside a capture costs one branch. */
#include "hypertrain/base.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

typedef struct span {
    char name[96];
    const char *cat;
    int track;
    double t0, t1;
    int64_t bytes, step;
} span;

bool ht_trace_on;

static struct {
    pthread_mutex_t lock;
    span *spans;
    size_t count, cap;
    bool dropped; /* out of memory: the capture went on without some spans */
} trace = {.lock = PTHREAD_MUTEX_INITIALIZER};

/* Tracks 0 (the thread that started the capture), 1 and 2 (the FSDP
 * exchanges); other threads from 10 on, in the order they first report. */
static _Thread_local int thread_track = -1;
static atomic_int next_track = 10;

void ht_trace_start(void) {
    thread_track = 0;
    ht_trace_on = true;
}

void ht_trace_stop(void) { ht_trace_on = false; }

void ht_trace_span(const char *cat, const char *name, int track, double t0, double t1, int64_t bytes, int64_t step) {
    if (!ht_trace_on) return;
    if (track == HT_TRACE_THREAD) {
        if (thread_track < 0) thread_track = atomic_fetch_add(&next_track, 1);
        track = thread_track;
    }
    pthread_mutex_lock(&trace.lock);
    if (trace.count == trace.cap) {
        size_t cap = trace.cap ? 2 * trace.cap : 1024;
        span *more = realloc(trace.spans, cap * sizeof(span));
        if (!more) {
            trace.dropped = true;
            pthread_mutex_unlock(&trace.lock);
            return;
        }
        trace.spans = more, trace.cap = cap;
    }
    span *s = &trace.spans[trace.count++];
    snprintf(s->name, sizeof(s->name), "%s", name);
    s->cat = cat, s->track = track, s->t0 = t0, s->t1 = t1 > t0 ? t1 : t0, s->bytes = bytes, s->step = step;
    pthread_mutex_unlock(&trace.lock);
}

/* Each track in time order; of two spans that start together the longer
 * (the enclosing one) first, so that a viewer nests them. */
static int by_track_and_time(const void *a, const void *b) {
    const span *x = a, *y = b;
    if (x->track != y->track) return x->track < y->track ? -1 : 1;
    if (x->t0 != y->t0) return x->t0 < y->t0 ? -1 : 1;
    return x->t1 > y->t1 ? -1 : x->t1 < y->t1 ? 1 : 0;
}

static void write_meta(FILE *f, int pid, int tid, const char *what, const char *name) {
    fprintf(f, "{\"name\": \"%s\", \"ph\": \"M\", \"pid\": %d, \"tid\": %d, \"args\": {\"name\": ", what, pid, tid);
    ht_json_write_string(f, name);
    fprintf(f, "}},\n");
}

void ht_trace_flush(FILE *f, int pid, bool first) {
    pthread_mutex_lock(&trace.lock);
    if (first) {
        char name[32];
        snprintf(name, sizeof(name), "rank %d", pid);
        write_meta(f, pid, 0, "process_name", name);
        write_meta(f, pid, 0, "thread_name", "main thread");
        write_meta(f, pid, HT_TRACE_GATHERS, "thread_name", "FSDP all-gathers in flight");
        write_meta(f, pid, HT_TRACE_REDUCES, "thread_name", "FSDP reduce-scatters in flight");
    }
    qsort(trace.spans, trace.count, sizeof(span), by_track_and_time);
    for (size_t i = 0; i < trace.count; i++) {
        const span *s = &trace.spans[i];
        fprintf(f, "{\"name\": ");
        ht_json_write_string(f, s->name);
        fprintf(f,
                ", \"cat\": \"%s\", \"ph\": \"X\", \"ts\": %.3f, \"dur\": %.3f, \"pid\": %d, \"tid\": %d, \"args\": {",
                s->cat, 1e6 * s->t0, 1e6 * (s->t1 - s->t0), pid, s->track);
        const char *sep = "";
        if (s->step >= 0) fprintf(f, "\"step\": %lld", (long long)s->step), sep = ", ";
        if (s->bytes >= 0) fprintf(f, "%s\"bytes\": %lld", sep, (long long)s->bytes);
        fprintf(f, "}},\n");
    }
    if (trace.dropped)
        fprintf(f,
                "{\"name\": \"spans dropped (out of memory)\", \"ph\": \"i\", \"s\": \"p\", \"ts\": %.3f, \"pid\": "
                "%d, \"tid\": 0},\n",
                trace.count ? 1e6 * trace.spans[trace.count - 1].t1 : 0.0, pid);
    trace.count = 0;
    trace.dropped = false;
    pthread_mutex_unlock(&trace.lock);
}
