/* The run directory (checkpoint.output_dir) as one run's own: an exclusive
 * lock held for the run's whole life, and the check, before anything is
 * written, that every name the run will write there is its to write. */
#include "hypertrain/train.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#define LOCK_NAME "hypertrain.lock"

/* Whether dir holds a checkpoint of this engine's (a step_X directory). */
static bool holds_own_checkpoint(const char *dir) {
    DIR *d = opendir(dir);
    if (!d) return false;
    bool own = false;
    struct dirent *e;
    while (!own && (e = readdir(d)) != NULL) {
        char why[600];
        own = strncmp(e->d_name, "step_", 5) == 0 && ht_ckpt_is_own(dir, e->d_name, why, sizeof(why));
    }
    closedir(d);
    return own;
}

/* Before the lock file is made: output_dir is a directory a run may own.
 * Never the root. An existing directory that no run of this engine has used
 * (no hypertrain.lock, no checkpoint of its own) is the user's: the names a
 * run replaces there (latest, loss.svg, final/, metrics.jsonl, samples.jsonl) are someone
 * else's files, refused unless checkpoint.overwrite. */
static ht_status check_owner(const char *output_dir, bool overwrite, ht_error *err) {
    char real[PATH_MAX], path[HT_CONFIG_STR_MAX + 32];
    if (realpath(output_dir, real) && strcmp(real, "/") == 0)
        return ht_fail(err, HT_ERR_CONFIG,
                       "checkpoint.output_dir %s is the root of the file system: a run writes hypertrain.lock, "
                       "metrics.jsonl, loss.svg, latest, step_*/ and final/ into its directory; choose one of its own "
                       "(for example runs/NAME)",
                       output_dir);
    struct stat sb;
    snprintf(path, sizeof(path), "%s/" LOCK_NAME, output_dir);
    if (stat(output_dir, &sb) != 0 || lstat(path, &sb) == 0 || holds_own_checkpoint(output_dir)) return HT_OK;
    static const char *const replaced[] = {"latest", "loss.svg", "final", "metrics.jsonl", "samples.jsonl"};
    char found[128] = "";
    for (size_t i = 0; i < sizeof(replaced) / sizeof(replaced[0]); i++) {
        snprintf(path, sizeof(path), "%s/%s", output_dir, replaced[i]);
        if (lstat(path, &sb) != 0) continue;
        /* a link where the run writes final/ or a .jsonl is check_entries' to name */
        if (S_ISLNK(sb.st_mode) && (strcmp(replaced[i], "final") == 0 || strstr(replaced[i], ".jsonl"))) continue;
        size_t at = strlen(found);
        snprintf(found + at, sizeof(found) - at, "%s%s", at ? ", " : "", replaced[i]);
    }
    if (!found[0]) return HT_OK;
    if (!overwrite)
        return ht_fail(err, HT_ERR_CONFIG,
                       "checkpoint.output_dir %s holds %s, which no run of this engine wrote (the directory has no "
                       "%s and no checkpoint of its own), and this run would replace them: choose a directory of its "
                       "own, or set checkpoint.overwrite: true to let it replace them",
                       output_dir, found, LOCK_NAME);
    ht_log_warn("checkpoint.overwrite: this run may replace %s in %s, which no run of this engine wrote", found,
                output_dir);
    return HT_OK;
}

/* Rank 0's half of ht_rundir_lock: flock on output_dir/hypertrain.lock,
 * then this run's pid, host and start time written into it for the next
 * run that finds it taken. The kernel drops the lock when the process
 * ends, however it ends: a lock is never stale. */
static ht_status take_lock(ht_run_lock *lock, const char *output_dir, bool overwrite, ht_error *err) {
    struct stat sb;
    ht_status s = check_owner(output_dir, overwrite, err);
    if (s != HT_OK) return s;
    lock->created_dir = stat(output_dir, &sb) != 0;
    s = ht_make_dirs(output_dir, err);
    if (s != HT_OK) return s;
    char path[HT_CONFIG_STR_MAX + 32];
    snprintf(path, sizeof(path), "%s/" LOCK_NAME, output_dir);
    int fd = open(path, O_RDWR | O_CREAT | O_NOFOLLOW | O_CLOEXEC, 0644);
    if (fd < 0)
        return ht_fail(err, HT_ERR_IO, "checkpoint.output_dir %s: cannot open its lock %s: %s%s", output_dir, path,
                       strerror(errno), errno == ELOOP ? " (a symbolic link: never written through)" : "");
    if (fstat(fd, &sb) != 0 || !S_ISREG(sb.st_mode)) {
        close(fd);
        return ht_fail(err, HT_ERR_IO, "checkpoint.output_dir %s: its lock %s is not a regular file", output_dir, path);
    }
    if (flock(fd, LOCK_EX | LOCK_NB) != 0) {
        int e = errno;
        if (e == EWOULDBLOCK) {
            char holder[512] = "";
            ssize_t n = pread(fd, holder, sizeof(holder) - 1, 0);
            holder[n > 0 ? n : 0] = '\0';
            holder[strcspn(holder, "\n")] = '\0';
            close(fd);
            return ht_fail(err, HT_ERR_IO,
                           "checkpoint.output_dir %s is in use by another run (%s): two runs never share a "
                           "directory; wait for it to end, stop it, or choose another output_dir",
                           output_dir, holder[0] ? holder : "it has not written its pid yet");
        }
        /* Lustre without -o flock, some FUSE file systems: no locks at all. */
        ht_log_warn("checkpoint.output_dir %s: the file system does not lock files (%s): nothing stops a second run "
                    "from writing into this directory at the same time",
                    output_dir, strerror(e));
        close(fd);
        return HT_OK;
    }
    char host[256] = "?", text[512], when[64];
    gethostname(host, sizeof(host));
    host[sizeof(host) - 1] = '\0';
    time_t now = time(NULL);
    struct tm tm;
    strftime(when, sizeof(when), "%Y-%m-%d %H:%M:%S UTC", gmtime_r(&now, &tm));
    int len = snprintf(text, sizeof(text), "pid %ld on host %s, since %s\n", (long)getpid(), host, when);
    if (ftruncate(fd, 0) != 0 || pwrite(fd, text, (size_t)len, 0) != len)
        ht_log_warn("%s: cannot write this run's pid into it: %s (the lock is held all the same)", path,
                    strerror(errno));
    lock->fd = fd;
    return HT_OK;
}

/* One rank's outcome, for every rank: the status and the message. */
static ht_status share_outcome(ht_comm *comm, ht_status s, ht_error *err) {
    if (comm->size == 1) return s;
    int32_t status = (int32_t)s;
    ht_broadcast(comm, &status, (int64_t)sizeof(status), 0);
    if (status == HT_OK) return HT_OK;
    ht_broadcast(comm, err->msg, (int64_t)sizeof(err->msg), 0);
    err->status = (ht_status)status;
    err->everywhere = true;
    return (ht_status)status;
}

ht_status ht_run_lock_take(ht_run_lock *lock, const char *output_dir, bool overwrite, ht_comm *comm, ht_error *err) {
    memset(lock, 0, sizeof(*lock));
    lock->fd = -1;
    snprintf(lock->dir, sizeof(lock->dir), "%s", output_dir);
    ht_status s = comm->rank == 0 ? take_lock(lock, output_dir, overwrite, err) : HT_OK;
    return share_outcome(comm, s, err);
}

void ht_run_lock_release(ht_run_lock *lock, bool remove_created) {
    if (lock->fd < 0) return;
    if (remove_created && lock->created_dir) {
        /* The run stopped before writing anything: the directory it made for
         * its lock goes too (rmdir leaves it if anything else is there). */
        char path[HT_CONFIG_STR_MAX + 32];
        snprintf(path, sizeof(path), "%s/" LOCK_NAME, lock->dir);
        unlink(path);
        rmdir(lock->dir);
    }
    close(lock->fd); /* closing the last descriptor drops the flock */
    lock->fd = -1;
}

/* "step_X" or "step_X.tmp": X, else -1. */
static long long checkpoint_step(const char *name, bool *tmp) {
    long long step;
    int used = 0;
    *tmp = false;
    if (strncmp(name, "step_", 5) != 0 || strspn(name + 5, "0123456789") != 8) return -1;
    if (sscanf(name, "step_%lld%n", &step, &used) != 1) return -1;
    if (strcmp(name + used, ".tmp") == 0)
        *tmp = true;
    else if (name[used] != '\0')
        return -1;
    return step;
}

static const char *kind_of(const struct stat *sb) {
    return S_ISLNK(sb->st_mode) ? "a symbolic link" : S_ISDIR(sb->st_mode) ? "a directory" : "not a regular file";
}

/* Rank 0's half of ht_rundir_check. */
static ht_status check_entries(const ht_config *cfg, int64_t first, int ranks, ht_error *err) {
    const char *dir = cfg->checkpoint.output_dir;
    const int64_t last = cfg->training.steps;
    char path[HT_CONFIG_STR_MAX + 64];
    struct stat sb;
    /* Files the run writes in place or through a temporary beside them:
     * written through a symlink, they would land outside the directory. */
    static const char *const files[] = {"metrics.jsonl", "metrics.jsonl.tmp", "samples.jsonl", "samples.jsonl.tmp",
                                        "loss.svg.tmp"};
    for (size_t i = 0; i < sizeof(files) / sizeof(files[0]); i++) {
        snprintf(path, sizeof(path), "%s/%s", dir, files[i]);
        if (lstat(path, &sb) == 0 && !S_ISREG(sb.st_mode))
            return ht_fail(err, HT_ERR_IO,
                           "%s is %s, where this run writes a file: move it away (nothing is ever "
                           "written through a link)",
                           path, kind_of(&sb));
    }
    /* training.trace: every rank's trace_rank{r}.json. */
    for (int r = 0; cfg->training.trace.on && r < ranks; r++) {
        snprintf(path, sizeof(path), "%s/trace_rank%d.json", dir, r);
        if (lstat(path, &sb) == 0 && !S_ISREG(sb.st_mode))
            return ht_fail(err, HT_ERR_IO,
                           "%s is %s, where this run writes a file: move it away (nothing is ever "
                           "written through a link)",
                           path, kind_of(&sb));
    }
    /* Directories it writes files into. */
    static const struct {
        const char *name, *what;
    } dirs[] = {{"final", "final weights"}, {"state", "state dumps"}, {"tensorboard", "TensorBoard events"}};
    const bool used[] = {true, cfg->training.dump_state,
                         cfg->training.tensorboard.on && !cfg->training.tensorboard.path[0]};
    for (size_t i = 0; i < sizeof(dirs) / sizeof(dirs[0]); i++) {
        if (!used[i]) continue;
        snprintf(path, sizeof(path), "%s/%s", dir, dirs[i].name);
        if (lstat(path, &sb) == 0 && !S_ISDIR(sb.st_mode))
            return ht_fail(err, HT_ERR_IO,
                           "%s is %s, where this run writes its %s: move it away (nothing is ever "
                           "written through a link)",
                           path, kind_of(&sb), dirs[i].what);
    }
    /* Checkpoint names that are not this engine's checkpoints. */
    DIR *d = opendir(dir);
    if (!d) return HT_OK; /* a fresh directory */
    ht_status s = HT_OK;
    struct dirent *e;
    while (s == HT_OK && (e = readdir(d)) != NULL) {
        bool tmp;
        long long step = checkpoint_step(e->d_name, &tmp);
        char why[600];
        if (step < 0 || ht_ckpt_is_own(dir, e->d_name, why, sizeof(why))) continue;
        if (step > first && step <= last)
            s = ht_fail(err, HT_ERR_IO,
                        "%s/%s %s, so it is not a checkpoint of this engine's, and this run (steps %lld to %lld) "
                        "may save step %lld there: move it away (it is never deleted nor written through)",
                        dir, e->d_name, why, (long long)first + 1, (long long)last, step);
        else
            ht_log_warn(
                "%s/%s %s: not a checkpoint of this engine's, left alone (it may be read, never replaced nor deleted)",
                dir, e->d_name, why);
    }
    closedir(d);
    return s;
}

ht_status ht_run_dir_check(const ht_config *cfg, int64_t first, ht_comm *comm, ht_error *err) {
    ht_status s = comm->rank == 0 ? check_entries(cfg, first, comm->size, err) : HT_OK;
    return share_outcome(comm, s, err);
}
