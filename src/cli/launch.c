/* `hypertrain launch`: stands between a scheduler (or a terminal) and a
 * training command, so that a preemption's signal ends in a stop checkpoint.
 * mpirun, signalled itself, kills its ranks a second after passing the
 * signal on; the launcher signals the training processes instead, waits for
 * their checkpoint within a grace period, and exits with their status (75). */
#include "cli/launch.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define DEFAULT_GRACE_SECONDS 120.0
#define KILL_AFTER_SECONDS 10.0 /* after the grace period: SIGTERM to the command, then SIGKILL this much later */

static volatile sig_atomic_t last_signal = 0, signal_count = 0;

static void on_signal(int sig) {
    last_signal = sig;
    signal_count++;
}

static double now_seconds(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* A process's parent and name from /proc/PID/stat; false if it is gone. */
static bool read_stat(pid_t pid, pid_t *ppid, char *name, size_t n) {
    char path[64], text[512];
    snprintf(path, sizeof(path), "/proc/%d/stat", (int)pid);
    FILE *f = fopen(path, "r");
    if (!f) return false;
    size_t len = fread(text, 1, sizeof(text) - 1, f);
    fclose(f);
    text[len] = '\0';
    /* "pid (name) state ppid ...": the name may hold spaces and ')' */
    char *open = strchr(text, '('), *close = strrchr(text, ')');
    if (!open || !close || close < open) return false;
    snprintf(name, n, "%.*s", (int)(close - open - 1), open + 1);
    char state;
    int parent;
    if (sscanf(close + 1, " %c %d", &state, &parent) != 2) return false;
    *ppid = (pid_t)parent;
    return true;
}

/* Sends sig to every `hypertrain` process that descends from root (root
 * itself included): the ranks mpirun started on this node, or the one
 * process. One rank is enough (the ranks agree on a stop at each step);
 * every local rank gets it, as a terminal's Ctrl-C would. Returns how many. */
static int signal_trainers(pid_t root, int sig) {
    enum { MAX_PROCS = 65536 };
    pid_t *pids = malloc(MAX_PROCS * sizeof(pid_t)), *parents = malloc(MAX_PROCS * sizeof(pid_t));
    bool *trainer = malloc(MAX_PROCS * sizeof(bool));
    int n = 0, sent = 0;
    DIR *d = opendir("/proc");
    struct dirent *e;
    while (d && pids && parents && trainer && n < MAX_PROCS && (e = readdir(d)) != NULL) {
        char *end;
        long pid = strtol(e->d_name, &end, 10);
        char name[64];
        if (*end || pid <= 0 || !read_stat((pid_t)pid, &parents[n], name, sizeof(name))) continue;
        pids[n] = (pid_t)pid;
        trainer[n++] = strcmp(name, "hypertrain") == 0;
    }
    if (d) closedir(d);
    for (int i = 0; i < n; i++) {
        if (!trainer[i]) continue;
        /* descends from root? (a chain of parents; bounded, as a pid may be reused mid-scan) */
        pid_t at = pids[i];
        for (int depth = 0; depth < 64 && at > 1 && at != root; depth++) {
            pid_t up = 0;
            for (int j = 0; j < n && !up; j++)
                if (pids[j] == at) up = parents[j];
            at = up;
        }
        if (at == root && kill(pids[i], sig) == 0) sent++;
    }
    free(pids);
    free(parents);
    free(trainer);
    return sent;
}

/* Copies what is readable on fd to out; false at its end. A closed `out`
 * (a `| tee` that a Ctrl-C ended) drops the bytes, never the run. */
static bool relay(int fd, int out) {
    char buf[65536];
    ssize_t got = read(fd, buf, sizeof(buf));
    if (got < 0 && (errno == EINTR || errno == EAGAIN)) return true;
    if (got <= 0) return false;
    for (ssize_t done = 0; done < got;) {
        ssize_t w = write(out, buf + done, (size_t)(got - done));
        if (w < 0 && errno == EINTR) continue;
        if (w <= 0) break; /* EPIPE: the log is gone */
        done += w;
    }
    return true;
}

static void launch_usage(FILE *f) {
    fprintf(f,
            "usage: hypertrain launch [--grace SECONDS] -- COMMAND [ARGS...]\n"
            "  runs COMMAND (mpirun ... hypertrain train ..., srun ..., or hypertrain train ...) and, on\n"
            "  SIGTERM, SIGINT or SIGHUP, passes the signal to its hypertrain processes (not to mpirun),\n"
            "  waits up to SECONDS (default %.0f) for their stop checkpoint and exits with their status\n"
            "  (75: stopped after saving); past the grace period it ends COMMAND. A second signal is\n"
            "  passed on at once (the ranks stop without saving). Output is relayed: a closed log\n"
            "  (| tee ended by the same Ctrl-C) stops the relay, never the run.\n",
            DEFAULT_GRACE_SECONDS);
}

int cmd_launch(int argc, char **argv) {
    double grace = DEFAULT_GRACE_SECONDS;
    int i = 0;
    for (; i < argc && strcmp(argv[i], "--") != 0; i++) {
        char *end = NULL;
        if (strcmp(argv[i], "--grace") == 0 && i + 1 < argc) {
            grace = strtod(argv[++i], &end);
            if (!end || *end || !(grace > 0 && grace < 1e7)) {
                fprintf(stderr, "hypertrain launch: --grace %s: expected a number of seconds > 0\n", argv[i]);
                return 2;
            }
        } else {
            fprintf(stderr, "hypertrain launch: unexpected argument '%s' before --\n", argv[i]);
            launch_usage(stderr);
            return 2;
        }
    }
    if (i + 1 >= argc) {
        launch_usage(stderr);
        return 2;
    }
    char **command = argv + i + 1;
    int out_pipe[2], err_pipe[2];
    if (pipe(out_pipe) != 0 || pipe(err_pipe) != 0) {
        fprintf(stderr, "hypertrain launch: cannot make pipes: %s\n", strerror(errno));
        return 1;
    }
    /* Handlers first: a signal from here on is the launcher's to pass on. */
    struct sigaction sa;
    memset(&sa, 0, sizeof(sa));
    sa.sa_handler = on_signal; /* no SA_RESTART: poll returns at once */
    sigemptyset(&sa.sa_mask);
    const int stops[] = {SIGTERM, SIGINT, SIGHUP};
    for (size_t k = 0; k < sizeof(stops) / sizeof(stops[0]); k++) sigaction(stops[k], &sa, NULL);
    signal(SIGPIPE, SIG_IGN);
    const pid_t launcher = getpid();
    pid_t child = fork();
    if (child < 0) {
        fprintf(stderr, "hypertrain launch: cannot start %s: %s\n", command[0], strerror(errno));
        return 1;
    }
    if (child == 0) {
        /* Its own process group: a terminal's Ctrl-C reaches the launcher
         * alone. No terminal input (mpirun would read it for rank 0, and in
         * a background group be stopped for it), and the job ends with its
         * launcher should that be killed outright. */
        setpgid(0, 0);
        prctl(PR_SET_PDEATHSIG, SIGTERM);
        if (getppid() != launcher) _exit(1); /* it died before the line above */
        int null = open("/dev/null", O_RDONLY);
        if (null >= 0) {
            dup2(null, STDIN_FILENO);
            close(null);
        }
        for (size_t k = 0; k < sizeof(stops) / sizeof(stops[0]); k++) signal(stops[k], SIG_DFL);
        signal(SIGPIPE, SIG_DFL);
        dup2(out_pipe[1], STDOUT_FILENO);
        dup2(err_pipe[1], STDERR_FILENO);
        close(out_pipe[0]);
        close(out_pipe[1]);
        close(err_pipe[0]);
        close(err_pipe[1]);
        execvp(command[0], command);
        fprintf(stderr, "hypertrain launch: cannot run %s: %s\n", command[0], strerror(errno));
        _exit(127);
    }
    setpgid(child, child);
    close(out_pipe[1]);
    close(err_pipe[1]);
    struct pollfd fds[2] = {{.fd = out_pipe[0], .events = POLLIN}, {.fd = err_pipe[0], .events = POLLIN}};
    int open_fds = 2, seen = 0, status = 0;
    double deadline = 0.0, kill_at = 0.0;
    bool exited = false;
    while (!exited || open_fds > 0) {
        int ready = poll(fds, 2, 200);
        for (int k = 0; ready > 0 && k < 2; k++)
            if (fds[k].fd >= 0 && (fds[k].revents & (POLLIN | POLLHUP | POLLERR)) &&
                !relay(fds[k].fd, k == 0 ? STDOUT_FILENO : STDERR_FILENO)) {
                close(fds[k].fd);
                fds[k].fd = -1;
                open_fds--;
            }
        if (!exited && waitpid(child, &status, WNOHANG) == child) exited = true;
        if (exited) continue;
        if (signal_count > seen) {
            seen = signal_count;
            int sig = last_signal, sent = signal_trainers(child, sig);
            if (sent == 0) kill(-child, sig); /* no trainer (yet): the command decides */
            if (seen == 1) {
                deadline = now_seconds() + grace;
                fprintf(stderr,
                        "hypertrain launch: %s: passed to the training processes, which finish the step, save a "
                        "checkpoint and stop; waiting up to %.0f s (--grace)\n",
                        strsignal(sig), grace);
            } else {
                fprintf(stderr,
                        "hypertrain launch: %s again: passed on; the training processes stop at once, without "
                        "saving\n",
                        strsignal(sig));
            }
        }
        double t = now_seconds();
        if (deadline > 0 && t > deadline && kill_at == 0.0) {
            fprintf(stderr, "hypertrain launch: the grace period of %.0f s ended before the run stopped: ending it\n",
                    grace);
            kill(-child, SIGTERM);
            kill_at = t + KILL_AFTER_SECONDS;
        }
        if (kill_at > 0 && t > kill_at) kill(-child, SIGKILL);
    }
    if (WIFEXITED(status)) return WEXITSTATUS(status);
    return 128 + WTERMSIG(status);
}
