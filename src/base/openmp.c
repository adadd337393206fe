/* How OpenMP's idle threads wait. A thread that finishes its share of a
 * parallel region waits for the next one by spinning on its core before it
 * sleeps (libgomp: GOMP_SPINCOUNT iterations, 300000 by default; LLVM's
 * libomp: KMP_BLOCKTIME, 200 ms). On a machine of its own that is fastest.
 * Where another process holds a core, the spinning thread takes the core
 * from the one with work to do. Measured on 2 cores (bench/RESULTS.md,
 * contention), the bf16 train step: idle machine 3004 tok/s with the default
 * spin, 2751 with 1000 iterations; one core taken 1205 and 1530.
 *
 * So a process that starts on a busy machine (other processes running)
 * spins 1000 iterations; on a quiet one it keeps the runtime's default. Both runtimes read these settings when
 * they load, before main: the process sets them and executes itself again,
 * once. The environment (OMP_WAIT_POLICY, GOMP_SPINCOUNT, KMP_BLOCKTIME)
 * always wins. */
#include "hypertrain/base.h"

#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#define CHOICE "HT_OPENMP_WAIT"

bool ht_openmp_machine_busy(const char *loadavg) {
    int running = 0, total = 0;
    if (!loadavg || sscanf(loadavg, "%*f %*f %*f %d/%d", &running, &total) != 2) return false;
    return running > 1; /* this process is one of them */
}

/* Busy: other processes were running in most of 5 looks 2 ms apart (the load
 * average would still remember a run that just ended). */
static bool machine_busy_now(void) {
    int busy = 0;
    for (int i = 0; i < 5; i++) {
        char text[128] = "";
        FILE *f = fopen("/proc/loadavg", "r");
        if (f) {
            if (!fgets(text, sizeof(text), f)) text[0] = '\0';
            fclose(f);
        }
        busy += ht_openmp_machine_busy(text);
        usleep(2000);
    }
    return busy >= 3;
}

void ht_openmp_settle(char **argv) {
    if (getenv("OMP_WAIT_POLICY") || getenv("GOMP_SPINCOUNT") || getenv("KMP_BLOCKTIME") || getenv(CHOICE)) return;
    if (!machine_busy_now()) {
        setenv(CHOICE, "default", 1); /* for the log; nothing to change */
        return;
    }
    setenv("GOMP_SPINCOUNT", "1000", 1);
    setenv("KMP_BLOCKTIME", "1", 1); /* milliseconds */
    setenv(CHOICE, "short", 1);
    execv("/proc/self/exe", argv); /* returns only on failure: then run with the runtime's defaults */
    setenv(CHOICE, "default", 1);
}

const char *ht_openmp_wait(void) {
    const char *choice = getenv(CHOICE);
    if (choice && choice[0] == 's')
        return "spin 1000 iterations, then sleep (the machine was busy at start; GOMP_SPINCOUNT or OMP_WAIT_POLICY "
               "choose otherwise)";
    if (choice) return "the OpenMP runtime's default spin (a quiet machine at start)";
    return "as OMP_WAIT_POLICY / GOMP_SPINCOUNT / KMP_BLOCKTIME in the environment say";
}
