/* The run directory, checked before the run writes into it (src/train/rundir.c;
 * its lock is public: ht_run_lock in train.h). */
#ifndef HT_TRAIN_RUNDIR_H
#define HT_TRAIN_RUNDIR_H

#include "hypertrain/train.h"

/* Before the run writes anything: every name it writes in output_dir is
 * absent or of the kind it writes (no symlink, no file where a directory
 * goes), and no entry named like a checkpoint that is not one of this
 * engine's sits at a step in (first, training.steps] that the run may save. Other
 * such entries are left alone with a warning. Rank 0 checks; every rank
 * learns the outcome. */
ht_status ht_run_dir_check(const ht_config *cfg, int64_t first, ht_comm *comm, ht_error *err);

#endif
