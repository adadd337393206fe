/* Fault injection for the tests (LD_PRELOAD): the calls that write under
 * HT_FAULT_DIR (open or fopen for writing, write, fwrite, fflush, fsync,
 * fclose, rename, mkdir) are counted, and call number HT_FAULT_AT fails with
 * HT_FAULT_ERRNO (ENOSPC, EIO or EACCES). HT_FAULT_COUNT names a file that
 * gets the number of calls counted when the process ends; with
 * HT_FAULT_SLOW_FSYNC_MS each of those fsyncs takes that long (a slow disk:
 * a save a test can signal in the middle of). Reads are left
 * alone; so are directories opened to fsync them (best effort in the engine). */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <execinfo.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#define MAX_FD 4096
#define MAX_FILES 256

static const char *dir;
static size_t dir_len;
static long fail_at, count, slow_fsync_ms;
static int fail_errno = ENOSPC;
static bool tracked_fd[MAX_FD];
static FILE *tracked_file[MAX_FILES];

__attribute__((constructor)) static void init(void) {
    dir = getenv("HT_FAULT_DIR");
    dir_len = dir ? strlen(dir) : 0;
    const char *at = getenv("HT_FAULT_AT"), *e = getenv("HT_FAULT_ERRNO");
    fail_at = at ? atol(at) : 0;
    const char *slow = getenv("HT_FAULT_SLOW_FSYNC_MS");
    slow_fsync_ms = slow ? atol(slow) : 0;
    if (e && strcmp(e, "EIO") == 0) fail_errno = EIO;
    if (e && strcmp(e, "EACCES") == 0) fail_errno = EACCES;
}

__attribute__((destructor)) static void report(void) {
    const char *path = getenv("HT_FAULT_COUNT");
    if (!path) return;
    FILE *(*real_fopen)(const char *, const char *) = dlsym(RTLD_NEXT, "fopen");
    FILE *f = real_fopen(path, "w");
    if (f) {
        fprintf(f, "%ld\n", count);
        fclose(f);
    }
}

static bool under(const char *path) { return dir && path && strncmp(path, dir, dir_len) == 0; }

/* One more counted call; true when this is the one to fail (errno set). */
static bool fails(const char *what) {
    if (++count != fail_at) return false;
    if (getenv("HT_FAULT_TRACE")) { /* which call site: the stack, for a failure the run did not report */
        fprintf(stderr, "fail_io: call %ld (%s) fails\n", count, what);
        void *frames[12];
        backtrace_symbols_fd(frames, backtrace(frames, 12), 2);
    }
    errno = fail_errno;
    return true;
}

static bool fd_tracked(int fd) { return fd >= 0 && fd < MAX_FD && tracked_fd[fd]; }

static bool file_tracked(FILE *f) {
    for (int i = 0; f && i < MAX_FILES; i++)
        if (tracked_file[i] == f) return true;
    return false;
}

static void track_file(FILE *f, bool on) {
    for (int i = 0; i < MAX_FILES; i++)
        if (on ? tracked_file[i] == NULL : tracked_file[i] == f) {
            tracked_file[i] = on ? f : NULL;
            return;
        }
}

static void *next(const char *name) { return dlsym(RTLD_NEXT, name); }

static int open_common(const char *name, const char *path, int flags, mode_t mode) {
    typedef int (*fn)(const char *, int, ...);
    fn real = (fn)dlsym(RTLD_NEXT, name);
    bool writes = (flags & (O_WRONLY | O_RDWR | O_CREAT)) != 0;
    if (writes && under(path) && fails(path)) return -1;
    int fd = real(path, flags, mode);
    if (writes && under(path) && fd >= 0 && fd < MAX_FD) tracked_fd[fd] = true;
    return fd;
}

int open(const char *path, int flags, ...) {
    va_list ap;
    va_start(ap, flags);
    mode_t mode = (flags & O_CREAT) ? (mode_t)va_arg(ap, int) : 0;
    va_end(ap);
    return open_common("open", path, flags, mode);
}

int open64(const char *path, int flags, ...) {
    va_list ap;
    va_start(ap, flags);
    mode_t mode = (flags & O_CREAT) ? (mode_t)va_arg(ap, int) : 0;
    va_end(ap);
    return open_common("open64", path, flags, mode);
}

static FILE *fopen_common(const char *name, const char *path, const char *mode) {
    typedef FILE *(*fn)(const char *, const char *);
    fn real = (fn)dlsym(RTLD_NEXT, name);
    bool writes = strpbrk(mode, "wa+") != NULL;
    if (writes && under(path) && fails(path)) return NULL;
    FILE *f = real(path, mode);
    if (f && writes && under(path)) {
        track_file(f, true);
        if (fileno(f) < MAX_FD) tracked_fd[fileno(f)] = true;
    }
    return f;
}

FILE *fopen(const char *path, const char *mode) { return fopen_common("fopen", path, mode); }
FILE *fopen64(const char *path, const char *mode) { return fopen_common("fopen64", path, mode); }

ssize_t write(int fd, const void *buf, size_t n) {
    static ssize_t (*real_write)(int, const void *, size_t);
    if (!real_write) real_write = next("write");
    if (fd_tracked(fd) && fails("write")) return -1;
    return real_write(fd, buf, n);
}

size_t fwrite(const void *buf, size_t size, size_t n, FILE *f) {
    static size_t (*real_fwrite)(const void *, size_t, size_t, FILE *);
    if (!real_fwrite) real_fwrite = next("fwrite");
    if (file_tracked(f) && fails("fwrite")) {
        f->_flags |= _IO_ERR_SEEN; /* as a failed write leaves a glibc stream: ferror() says so */
        return 0;
    }
    return real_fwrite(buf, size, n, f);
}

int fflush(FILE *f) {
    static int (*real_fflush)(FILE *);
    if (!real_fflush) real_fflush = next("fflush");
    /* Only a flush with something to write can fail to write it. */
    if (file_tracked(f) && f->_IO_write_ptr > f->_IO_write_base && fails("fflush")) {
        f->_flags |= _IO_ERR_SEEN;
        return EOF;
    }
    return real_fflush(f);
}

int fsync(int fd) {
    static int (*real_fsync)(int);
    if (!real_fsync) real_fsync = next("fsync");
    if (fd_tracked(fd) && fails("fsync")) return -1;
    if (fd_tracked(fd) && slow_fsync_ms > 0) usleep((useconds_t)slow_fsync_ms * 1000);
    return real_fsync(fd);
}

int fclose(FILE *f) {
    static int (*real_fclose)(FILE *);
    if (!real_fclose) real_fclose = next("fclose");
    bool tracked = file_tracked(f);
    if (tracked) {
        track_file(f, false);
        if (fileno(f) >= 0 && fileno(f) < MAX_FD) tracked_fd[fileno(f)] = false;
    }
    int rc = real_fclose(f); /* closed either way: a failing fclose still releases the stream */
    if (tracked && rc == 0 && fails("fclose")) return EOF;
    return rc;
}

int close(int fd) {
    static int (*real_close)(int);
    if (!real_close) real_close = next("close");
    if (fd >= 0 && fd < MAX_FD) tracked_fd[fd] = false;
    return real_close(fd);
}

int rename(const char *from, const char *to) {
    static int (*real_rename)(const char *, const char *);
    if (!real_rename) real_rename = next("rename");
    if (under(to) && fails(to)) return -1;
    return real_rename(from, to);
}

int mkdir(const char *path, mode_t mode) {
    static int (*real_mkdir)(const char *, mode_t);
    if (!real_mkdir) real_mkdir = next("mkdir");
    if (under(path) && fails(path)) return -1;
    return real_mkdir(path, mode);
}
