/* Errors as values: ht_fail formats a sentence into the caller's ht_error.
 * Also the aligned allocator and the opening and whole-file reading of the
 * files a user names, the things every layer needs and that can fail with a
 * message. */
#include "hypertrain/base.h"

#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

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

/* The pages of a large block made present, writable, across the threads in
 * the static split the passes over it use: one fault each, taken in
 * parallel. Left to their first access they cost more: a pass that reads
 * before it writes (AdamW's moments, main_grad's accumulation) maps the
 * shared zero page first, then faults again on the write and flushes the
 * other threads' TLBs, two to three times the kernel time of this. Where
 * the kernel has no MADV_POPULATE_WRITE (before Linux 5.14), zeros written
 * by the same threads do it. */
enum { POPULATE_MIN = 16 << 20, POPULATE_PIECE = 4 << 20 };
static void populate(char *block, size_t bytes) {
    const uintptr_t page = (uintptr_t)sysconf(_SC_PAGESIZE);
    char *first = (char *)(((uintptr_t)block + page - 1) & ~(page - 1));
    if (bytes < POPULATE_MIN || first >= block + bytes) return;
    const size_t span = (size_t)(block + bytes - first) & ~(size_t)(page - 1);
    const int64_t pieces = (int64_t)((span + POPULATE_PIECE - 1) / POPULATE_PIECE);
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < pieces; i++) {
        const size_t off = (size_t)i * POPULATE_PIECE, len = span - off < POPULATE_PIECE ? span - off : POPULATE_PIECE;
        char *at = first + off;
#ifdef MADV_POPULATE_WRITE
        if (madvise(at, len, MADV_POPULATE_WRITE) == 0) continue;
#endif
        memset(at, 0, len);
    }
}

/* calloc, not posix_memalign and memset: a large block comes from the
 * kernel already zero and calloc leaves it unwritten, so no thread writes
 * zeros over it; populate then maps its pages in parallel. calloc aligns to
 * 16 bytes: 64 more give room to align, and the word before the block
 * holds calloc's pointer for ht_free. */
void *ht_alloc(size_t bytes) {
    size_t rounded = ht_align64(bytes);
    if (rounded == 0) rounded = 64;
    if (rounded > SIZE_MAX - 64) return NULL;
    char *raw = calloc(1, rounded + 64);
    if (!raw) return NULL;
    char *ptr = (char *)(((uintptr_t)raw + 64) & ~(uintptr_t)63);
    ((void **)ptr)[-1] = raw;
    populate(ptr, rounded);
    return ptr;
}

void ht_free(void *ptr) {
    if (ptr) free(((void **)ptr)[-1]);
}

size_t ht_physical_memory(void) {
    long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGESIZE);
    if (pages <= 0 || page <= 0) return SIZE_MAX; /* unknown: nothing is refused for it */
    return (size_t)pages * (size_t)page;
}

static const char *file_kind(mode_t mode) {
    if (S_ISDIR(mode)) return "a directory";
    if (S_ISFIFO(mode)) return "a FIFO (named pipe)";
    if (S_ISCHR(mode)) return "a character device";
    if (S_ISBLK(mode)) return "a block device";
    if (S_ISSOCK(mode)) return "a socket";
    return "something other than a regular file";
}

ht_status ht_open_file(const char *path, int *fd_out, size_t *size, ht_error *err) {
    *fd_out = -1;
    *size = 0;
    /* O_NONBLOCK: a FIFO opened for reading otherwise waits for a writer, forever. */
    int fd = open(path, O_RDONLY | O_NONBLOCK | O_CLOEXEC);
    if (fd < 0) return ht_fail(err, HT_ERR_IO, "%s: cannot open: %s", path, strerror(errno));
    struct stat sb;
    if (fstat(fd, &sb) != 0) {
        ht_status s = ht_fail(err, HT_ERR_IO, "%s: cannot stat: %s", path, strerror(errno));
        close(fd);
        return s;
    }
    if (!S_ISREG(sb.st_mode)) {
        close(fd);
        return ht_fail(err, HT_ERR_IO, "%s: expected a file, found %s", path, file_kind(sb.st_mode));
    }
    int flags = fcntl(fd, F_GETFL);
    if (flags < 0 || fcntl(fd, F_SETFL, flags & ~O_NONBLOCK) != 0) {
        ht_status s = ht_fail(err, HT_ERR_IO, "%s: cannot make the descriptor blocking: %s", path, strerror(errno));
        close(fd);
        return s;
    }
    *fd_out = fd;
    *size = (size_t)sb.st_size;
    return HT_OK;
}

ht_status ht_read_file(const char *path, char **out, size_t *out_size, ht_error *err) {
    return ht_read_file_max(path, ht_physical_memory(), "the memory of this machine holds", out, out_size, err);
}

ht_status ht_read_file_max(const char *path, size_t max_bytes, const char *what, char **out, size_t *out_size,
                           ht_error *err) {
    *out = NULL;
    if (out_size) *out_size = 0;
    int fd;
    size_t size;
    ht_status s = ht_open_file(path, &fd, &size, err);
    if (s != HT_OK) return s;
    /* The size is known before a byte is read or allocated: a file over the cap costs nothing. */
    if (size > max_bytes) {
        close(fd);
        if (out_size) *out_size = size;
        bool mib = max_bytes >= ((size_t)1 << 20);
        return ht_fail(err, HT_ERR_FORMAT, "%s: %zu bytes, more than the %zu %s %s", path, size,
                       mib ? max_bytes >> 20 : max_bytes, mib ? "MiB" : "bytes", what ? what : "a file may have");
    }
    char *buf = size < SIZE_MAX ? malloc(size + 1) : NULL;
    if (!buf) {
        close(fd);
        return ht_fail(err, HT_ERR_OOM, "%s: cannot allocate %zu bytes", path, size);
    }
    size_t got = 0;
    int why = 0;
    while (got < size && why == 0) {
        ssize_t n = read(fd, buf + got, size - got);
        if (n > 0)
            got += (size_t)n;
        else if (n == 0)
            break;
        else if (errno != EINTR)
            why = errno;
    }
    close(fd);
    if (got != size) {
        free(buf);
        return ht_fail(err, HT_ERR_IO, "%s: read %zu of %zu bytes (%s)", path, got, size,
                       why ? strerror(why) : "the file got shorter while it was read");
    }
    buf[size] = '\0';
    *out = buf;
    if (out_size) *out_size = size;
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
