/* TensorBoard's event files without TensorFlow: each Event protobuf
 * (wall_time, step, and a Summary of scalar values, or the file_version and
 * SessionLog records) encoded by hand, framed as a TFRecord (length, masked
 * CRC-32C of it, data, masked CRC-32C of it) and appended to the file. */
#include "train/events.h"

#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

/* Protobuf's wire format: a key is (field << 3) | wire type; 0 a varint,
 * 1 8 bytes, 2 a length then bytes, 5 4 bytes. Little-endian throughout. */
enum { VARINT = 0, FIXED64 = 1, BYTES = 2, FIXED32 = 5 };

typedef struct bytes {
    unsigned char *p;
    size_t len, cap;
    bool failed;
} bytes;

static void put(bytes *b, const void *data, size_t n) {
    if (b->failed) return;
    if (b->len + n > b->cap) {
        size_t cap = b->cap ? 2 * b->cap : 256;
        while (cap < b->len + n) cap *= 2;
        unsigned char *p = realloc(b->p, cap);
        if (!p) {
            b->failed = true;
            return;
        }
        b->p = p, b->cap = cap;
    }
    memcpy(b->p + b->len, data, n);
    b->len += n;
}

static void put_varint(bytes *b, uint64_t v) {
    unsigned char buf[10];
    size_t n = 0;
    do {
        buf[n++] = (unsigned char)((v & 0x7f) | (v > 0x7f ? 0x80 : 0));
        v >>= 7;
    } while (v);
    put(b, buf, n);
}

static void put_le(bytes *b, uint64_t v, int n) {
    unsigned char buf[8];
    for (int i = 0; i < n; i++) buf[i] = (unsigned char)(v >> (8 * i));
    put(b, buf, (size_t)n);
}

static void put_key(bytes *b, int field, int wire) { put_varint(b, (uint64_t)(field << 3 | wire)); }

static void put_field_bytes(bytes *b, int field, const void *data, size_t n) {
    put_key(b, field, BYTES);
    put_varint(b, n);
    put(b, data, n);
}

static void put_double(bytes *b, int field, double v) {
    uint64_t u;
    memcpy(&u, &v, sizeof(u));
    put_key(b, field, FIXED64);
    put_le(b, u, 8);
}

static double wall_time(void) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

uint32_t ht_events_masked_crc(const void *data, size_t n) {
    uint32_t crc = ht_crc32c(data, n, 0);
    return ((crc >> 15) | (crc << 17)) + 0xa282ead8u;
}

/* One record: the Event in `event`, framed, into the file's buffer. */
static ht_status write_record(ht_events *w, const bytes *event, ht_error *err) {
    if (event->failed) return ht_fail(err, HT_ERR_OOM, "%s: out of memory for an event", w->path);
    bytes r = {0};
    put_le(&r, event->len, 8);
    uint32_t len_crc = ht_events_masked_crc(r.p, 8);
    put_le(&r, len_crc, 4);
    put(&r, event->p, event->len);
    put_le(&r, ht_events_masked_crc(event->p, event->len), 4);
    bool ok = !r.failed && fwrite(r.p, 1, r.len, w->f) == r.len;
    int e = errno;
    free(r.p);
    if (r.failed) return ht_fail(err, HT_ERR_OOM, "%s: out of memory for an event", w->path);
    if (!ok)
        return ht_fail(err, HT_ERR_IO, "%s: cannot write step %lld's event: %s", w->path, (long long)w->step,
                       strerror(e));
    return HT_OK;
}

ht_status ht_events_open(ht_events *w, const char *dir, int64_t first_step, ht_error *err) {
    memset(w, 0, sizeof(*w));
    ht_status s = ht_make_dirs(dir, err);
    if (s != HT_OK) return s;
    char host[256] = "localhost";
    if (gethostname(host, sizeof(host) - 1) != 0) snprintf(host, sizeof(host), "localhost");
    host[sizeof(host) - 1] = '\0';
    /* A second file of this process within the same second (a resume in one
     * process) takes a suffix, which sorts after the first. */
    const long long now = (long long)time(NULL);
    int fd = -1;
    for (int k = 0; fd < 0 && k < 100; k++) {
        snprintf(w->path, sizeof(w->path), "%s/events.out.tfevents.%010lld.%s.%ld%s%.0d", dir, now, host,
                 (long)getpid(), k ? "." : "", k);
        fd = open(w->path, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0644); /* never through a link */
        if (fd < 0 && errno != EEXIST) break;
    }
    w->f = fd >= 0 ? fdopen(fd, "w") : NULL;
    if (!w->f) {
        if (fd >= 0) close(fd);
        return ht_fail(err, HT_ERR_IO, "%s: cannot create the TensorBoard event file: %s", w->path, strerror(errno));
    }
    bytes e = {0};
    put_double(&e, 1, wall_time());
    put_field_bytes(&e, 3, "brain.Event:2", 13); /* file_version: 2 makes the reader honour SessionLog START */
    s = write_record(w, &e, err);
    if (s == HT_OK && first_step > 1) {
        bytes log = {0};
        put_key(&log, 1, VARINT); /* SessionLog.status */
        put_varint(&log, 1);      /* START */
        e.len = 0;
        put_double(&e, 1, wall_time());
        put_key(&e, 2, VARINT);
        put_varint(&e, (uint64_t)first_step);
        put_field_bytes(&e, 7, log.p, log.len); /* Event.session_log */
        e.failed |= log.failed;
        free(log.p);
        s = write_record(w, &e, err);
    }
    free(e.p);
    if (s == HT_OK) s = ht_events_flush(w, err);
    if (s != HT_OK) {
        fclose(w->f);
        w->f = NULL;
    }
    return s;
}

void ht_events_begin(ht_events *w, int64_t step) {
    w->step = step;
    w->len = 0;
}

void ht_events_scalar(ht_events *w, const char *tag, double value) {
    if (!isfinite(value)) return;
    bytes v = {0}, sum = {.p = w->summary, .len = w->len, .cap = w->cap};
    const float f = (float)value;
    uint32_t u;
    memcpy(&u, &f, sizeof(u));
    put_field_bytes(&v, 1, tag, strlen(tag)); /* Summary.Value.tag */
    put_key(&v, 2, FIXED32);                  /* Summary.Value.simple_value */
    put_le(&v, u, 4);
    put_field_bytes(&sum, 1, v.p, v.len); /* Summary.value, repeated */
    w->out_of_room |= v.failed || sum.failed;
    free(v.p);
    w->summary = sum.p, w->len = sum.len, w->cap = sum.cap;
}

ht_status ht_events_end(ht_events *w, ht_error *err) {
    if (w->out_of_room) {
        w->out_of_room = false;
        return ht_fail(err, HT_ERR_OOM, "%s: out of memory for step %lld's event", w->path, (long long)w->step);
    }
    if (w->len == 0) return HT_OK;
    bytes e = {0};
    put_double(&e, 1, wall_time());
    put_key(&e, 2, VARINT);
    put_varint(&e, (uint64_t)w->step);
    put_field_bytes(&e, 5, w->summary, w->len); /* Event.summary */
    ht_status s = write_record(w, &e, err);
    free(e.p);
    w->len = 0;
    return s;
}

ht_status ht_events_flush(ht_events *w, ht_error *err) {
    if (!w->f) return HT_OK;
    if (fflush(w->f) != 0 || ferror(w->f))
        return ht_fail(err, HT_ERR_IO, "%s: cannot write the TensorBoard events up to step %lld: %s", w->path,
                       (long long)w->step, strerror(errno));
    return HT_OK;
}

ht_status ht_events_close(ht_events *w, ht_error *err) {
    free(w->summary);
    w->summary = NULL;
    w->len = w->cap = 0;
    if (!w->f) return HT_OK;
    FILE *f = w->f;
    w->f = NULL;
    bool kept = fflush(f) == 0 && !ferror(f) && fsync(fileno(f)) == 0;
    int e = errno;
    if (fclose(f) != 0 && kept) kept = false, e = errno;
    if (!kept)
        return ht_fail(err, HT_ERR_IO, "%s: cannot finish writing the TensorBoard events: %s", w->path, strerror(e));
    return HT_OK;
}
