/* A whole run of a loaded config, as `hypertrain train` and the Python
 * package's hypertrain.train() run it: the run directory's lock first, the
 * plugins, the trainer built and run, the lock released. */
#include "hypertrain/train.h"

#include <dlfcn.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* training.plugin: shared libraries that register models or datasets when loaded. */
static ht_status load_plugins(const ht_config *cfg, ht_error *err) {
    for (int i = 0; i < cfg->training.plugin.count; i++) {
        const char *path = cfg->training.plugin.items[i];
        /* A path (not a name the loader searches for) is checked first: dlopen would wait on a FIFO forever. */
        if (strchr(path, '/')) {
            int fd;
            size_t size;
            if (ht_open_file(path, &fd, &size, err) != HT_OK) {
                char why[sizeof(err->msg)];
                snprintf(why, sizeof(why), "%s", err->msg);
                return ht_fail(err, HT_ERR_IO, "training.plugin: %s", why);
            }
            close(fd);
        }
        void *handle = dlopen(path, RTLD_NOW | RTLD_GLOBAL);
        if (!handle) return ht_fail(err, HT_ERR_IO, "training.plugin: cannot load %s: %s", path, dlerror());
        void (*init)(void) = (void (*)(void))dlsym(handle, "hypertrain_plugin_init");
        if (init) init();
        ht_log_info("loaded plugin %s", path);
    }
    return HT_OK;
}

ht_status ht_train(const ht_config *cfg, ht_comm *comm, volatile sig_atomic_t *stop_request, int *stopped_by,
                   ht_error *err) {
    *stopped_by = 0;
    ht_run_lock lock = {.fd = -1};
    /* Before anything is read from or written to it, the directory is this run's alone. */
    if (ht_run_lock_take(&lock, cfg->checkpoint.output_dir, cfg->checkpoint.overwrite, comm, err) != HT_OK)
        return err->status;
    ht_trainer *t = malloc(sizeof(ht_trainer));
    if (!t) {
        ht_run_lock_release(&lock, true);
        return ht_fail(err, HT_ERR_OOM, "out of memory for the trainer");
    }
    ht_status s = load_plugins(cfg, err);
    if (s == HT_OK) s = ht_trainer_init_on(t, cfg, comm, err);
    if (s != HT_OK) {
        ht_run_lock_release(&lock, true); /* it wrote nothing yet */
        free(t);
        return s;
    }
    t->stop_request = stop_request;
    s = ht_trainer_run(t, err);
    *stopped_by = t->stopped_by;
    ht_trainer_free(t);
    free(t);
    ht_run_lock_release(&lock, false);
    return s;
}
