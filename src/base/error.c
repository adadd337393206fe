/* Errors as values: ht_fail formats a sentence into the caller's ht_error.
 * Also the aligned allocator and whole-file reading, the two things every
 * layer needs and that can fail with a message. */
#include "hypertrain/base.h"

#include <errno.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

ht_status ht_fail(ht_error *err, ht_status status, const char *fmt, ...) {
    if (err) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(err->msg, sizeof(err->msg), fmt, ap);
        va_end(ap);
        err->status = status;
        err->everywhere = false;
    }
    return status;
}

const char *ht_status_name(ht_status status) {
    switch (status) {
    case HT_OK: return "ok";
    case HT_ERR_IO: return "I/O error";
    case HT_ERR_FORMAT: return "format error";
    case HT_ERR_CONFIG: return "configuration error";
    case HT_ERR_INVALID: return "invalid argument";
    case HT_ERR_OOM: return "out of memory";
    case HT_ERR_NUMERIC: return "numeric error";
    }
    return "unknown error";
}

void *ht_alloc(size_t bytes) {
    void *ptr = NULL;
    size_t rounded = (bytes + 63) & ~(size_t)63;
    if (rounded == 0) rounded = 64;
    if (posix_memalign(&ptr, 64, rounded) != 0) return NULL;
    memset(ptr, 0, rounded);
    return ptr;
}

void ht_free(void *ptr) { free(ptr); }

ht_status ht_read_file(const char *path, char **out, size_t *out_size, ht_error *err) {
    return ht_read_file_max(path, (size_t)LONG_MAX, NULL, out, out_size, err);
}

ht_status ht_read_file_max(const char *path, size_t max_bytes, const char *what, char **out, size_t *out_size,
                           ht_error *err) {
    *out = NULL;
    if (out_size) *out_size = 0;
    FILE *f = fopen(path, "rb");
    if (!f) return ht_fail(err, HT_ERR_IO, "%s: cannot open: %s", path, strerror(errno));
    /* A directory opens for reading, and its "size" is no size at all. */
    struct stat sb = {0};
    if (fstat(fileno(f), &sb) != 0 || !S_ISREG(sb.st_mode)) {
        fclose(f);
        return ht_fail(err, HT_ERR_IO, "%s: expected a file, found %s", path,
                       S_ISDIR(sb.st_mode) ? "a directory" : "something else (not a regular file)");
    }
    if (fseek(f, 0, SEEK_END) != 0) {
        fclose(f);
        return ht_fail(err, HT_ERR_IO, "%s: cannot seek (not a regular file?)", path);
    }
    long size = ftell(f);
    if (size < 0 || fseek(f, 0, SEEK_SET) != 0) {
        fclose(f);
        return ht_fail(err, HT_ERR_IO, "%s: cannot determine the size", path);
    }
    if ((unsigned long)size > max_bytes) {
        fclose(f);
        bool mib = max_bytes >= ((size_t)1 << 20);
        return ht_fail(err, HT_ERR_FORMAT, "%s: %ld bytes, more than the %zu %s %s", path, size,
                       mib ? max_bytes >> 20 : max_bytes, mib ? "MiB" : "bytes", what ? what : "a file may have");
    }
    char *buf = malloc((size_t)size + 1);
    if (!buf) {
        fclose(f);
        return ht_fail(err, HT_ERR_OOM, "%s: cannot allocate %ld bytes", path, size);
    }
    size_t got = fread(buf, 1, (size_t)size, f);
    int bad = ferror(f);
    fclose(f);
    if (bad || got != (size_t)size) {
        free(buf);
        return ht_fail(err, HT_ERR_IO, "%s: read %zu of %ld bytes", path, got, size);
    }
    buf[size] = '\0';
    *out = buf;
    if (out_size) *out_size = (size_t)size;
    return HT_OK;
}

ht_status ht_make_dirs(const char *path, ht_error *err) {
    char buf[4096];
    size_t n = strlen(path);
    if (n == 0 || n >= sizeof(buf)) return ht_fail(err, HT_ERR_INVALID, "invalid directory path '%s'", path);
    memcpy(buf, path, n + 1);
    for (size_t i = 1; i <= n; i++) {
        if (buf[i] != '/' && buf[i] != '\0') continue;
        char saved = buf[i];
        buf[i] = '\0';
        if (mkdir(buf, 0755) != 0 && errno != EEXIST) {
            ht_status s = ht_fail(err, HT_ERR_IO, "%s: cannot create directory: %s", buf, strerror(errno));
            return s;
        }
        buf[i] = saved;
    }
    struct stat st;
    if (stat(path, &st) != 0 || !S_ISDIR(st.st_mode))
        return ht_fail(err, HT_ERR_IO, "%s: exists and is not a directory", path);
    return HT_OK;
}
