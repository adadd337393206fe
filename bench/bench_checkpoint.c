/* Checkpoint save and load throughput for the 31M model (vocab 8192, hidden
 * 512, 8 layers, 8 heads, 2 KV heads, intermediate 1408) in bf16 with FP32
 * main params and full AdamW state on every parameter, against the disk's
 * sequential write speed measured in the same run (dd with conv=fsync).
 * Load is timed cold (the files dropped from the page cache first) and warm.
 * usage: bench_checkpoint [DIR] [REPEATS] */
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "hypertrain/ckpt.h"
#include "bench_models.h"
#include "hypertrain/model.h"
#include "hypertrain/optimizer.h"

static void check(ht_status s, const ht_error *err) {
    if (s != HT_OK) {
        fprintf(stderr, "bench_checkpoint: %s\n", err->msg);
        exit(1);
    }
}

static uint64_t file_size(const char *path) {
    struct stat sb;
    return stat(path, &sb) == 0 ? (uint64_t)sb.st_size : 0;
}

/* Asks the kernel to drop a (clean, fsynced) file's pages from the cache. */
static void drop_cache(const char *path) {
    int fd = open(path, O_RDONLY);
    if (fd < 0) return;
    posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
    close(fd);
}

int main(int argc, char **argv) {
    const char *dir = argc > 1 ? argv[1] : "bench_ckpt";
    int repeats = argc > 2 ? atoi(argv[2]) : 3;
    ht_log_set_level(HT_LOG_WARN);
    ht_error err;
    ht_model_config mc = bench_model_31m();
    ht_model *m;
    check(ht_model_build(&mc, HT_DTYPE_F32, 1, &m, &err), &err);
    check(ht_params_convert(&m->params, HT_DTYPE_BF16, &err), &err);
    ht_optimizer_config oc = {0};
    oc.fp32_main_params = true;
    oc.adamw = (ht_adamw_config){.lr = 1e-3, .beta1 = 0.9, .beta2 = 0.999, .eps = 1e-8};
    oc.adamw_schedule = (ht_lr_schedule){.type = HT_LR_CONSTANT_WARMUP, .base_lr = 1e-3, .total_steps = 10};
    oc.muon_schedule = oc.adamw_schedule;
    oc.max_norm = 1.0;
    ht_optimizer opt;
    check(ht_optimizer_init(&opt, &m->params, &oc, &err), &err); /* every param to AdamW: the largest state */
    for (int i = 0; i < opt.adamw->count; i++) {
        ht_adamw_slot *s = &opt.adamw->slots[i];
        for (int64_t k = 0; k < ht_param_local_numel(s->param); k++) {
            s->exp_avg[k] = 1e-3f * (float)(k % 977);
            s->exp_avg_sq[k] = 1e-6f * (float)(k % 911);
        }
        s->step = 1;
    }
    ht_ckpt_view v = {.params = &m->params, .optimizer = &opt, .model = &mc};
    v.state.step = 1;
    ht_ckpt_save_options so = {.save_optimizer = true, .keep_last = 1};

    char path[8400], ck[4200];
    check(ht_make_dirs(dir, &err), &err);
    double best_save = 0, best_cold = 0, best_warm = 0, best_dd = 0;
    uint64_t bytes = 0;
    for (int r = 0; r < repeats; r++) {
        /* Save (fsync of every file, metadata, the directories). */
        double t0 = ht_time_seconds();
        check(ht_ckpt_save(dir, &v, &so, ck, sizeof(ck), &err), &err);
        double t_save = ht_time_seconds() - t0;
        snprintf(path, sizeof(path), "%s/rank_00000.safetensors", ck);
        bytes = file_size(path);
        /* The disk: the same number of bytes through dd with fsync. */
        snprintf(path, sizeof(path), "dd if=/dev/zero of='%s/dd.bin' bs=1M count=%llu conv=fsync status=none", dir,
                 (unsigned long long)(bytes >> 20));
        t0 = ht_time_seconds();
        if (system(path) != 0) fprintf(stderr, "bench_checkpoint: dd failed\n");
        double t_dd = ht_time_seconds() - t0;
        snprintf(path, sizeof(path), "%s/dd.bin", dir);
        unlink(path);
        /* Load, cold then warm: open (hash check of every file) + planner copy. */
        double t_load[2];
        for (int warm = 0; warm < 2; warm++) {
            snprintf(path, sizeof(path), "%s/rank_00000.safetensors", ck);
            if (!warm) drop_cache(path);
            t0 = ht_time_seconds();
            ht_checkpoint *c;
            check(ht_ckpt_open(ck, &c, &err), &err);
            check(ht_ckpt_load(c, &v, true, &err), &err);
            ht_ckpt_close(c);
            t_load[warm] = ht_time_seconds() - t0;
        }
        double gb = (double)bytes / 1e9, dd_gb = (double)((bytes >> 20) << 20) / 1e9;
        printf("run %d: %.1f MB checkpoint; save %.3f s (%.3f GB/s), load cold %.3f s (%.3f GB/s), warm %.3f s "
               "(%.3f GB/s); dd conv=fsync %.3f s (%.3f GB/s)\n",
               r + 1, (double)bytes / 1e6, t_save, gb / t_save, t_load[0], gb / t_load[0], t_load[1], gb / t_load[1],
               t_dd, dd_gb / t_dd);
        if (gb / t_save > best_save) best_save = gb / t_save;
        if (gb / t_load[0] > best_cold) best_cold = gb / t_load[0];
        if (gb / t_load[1] > best_warm) best_warm = gb / t_load[1];
        if (dd_gb / t_dd > best_dd) best_dd = dd_gb / t_dd;
        v.state.step++;
    }
    printf("best of %d: disk (dd, fsync) %.3f GB/s; save %.3f GB/s = %.0f%% of disk; load cold %.3f GB/s = %.0f%%, "
           "warm %.3f GB/s; hash xxh64\n",
           repeats, best_dd, best_save, 100 * best_save / best_dd, best_cold, 100 * best_cold / best_dd, best_warm);
    ht_optimizer_free(&opt);
    ht_model_free(m);
    return 0;
}
