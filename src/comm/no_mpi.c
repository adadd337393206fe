/* A build without MPI (cmake -DHT_MPI=OFF): one process only. A launcher's
 * world of one is that process; a larger one is refused by name, as is any
 * group of several ranks (none can be made). */
#include "comm/comm_internal.h"

#ifdef HT_NO_MPI /* else comm/mpi.c */

#include <stdlib.h>

ht_status ht_comm_mpi_init(int *argc, char ***argv, int announced, const char *which, ht_comm **out, ht_error *err) {
    (void)argc, (void)argv;
    *out = ht_comm_single();
    if (announced <= 1) return HT_OK;
    return ht_fail(err, HT_ERR_INVALID,
                   "%s=%d: started as %d processes, but this build has no MPI (cmake -DHT_MPI=OFF): one process only",
                   which, announced, announced);
}

ht_status ht_comm_mpi_split(ht_comm *c, int color, int key, ht_comm **out, ht_error *err) {
    (void)color, (void)key;
    *out = ht_comm_single();
    return ht_fail(err, HT_ERR_INVALID, "a group of %d ranks in a build without MPI", c->size);
}

void ht_comm_mpi_abort(ht_comm *c, int code) {
    (void)c;
    exit(code);
}

void ht_comm_mpi_set_timeout(double seconds) { (void)seconds; }

#endif /* HT_NO_MPI */
