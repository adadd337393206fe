/* A build without MPI (cmake -DHT_MPI=OFF): one process only. A launcher's
 * world of one is that process; a larger one is refused by name. */
#include "comm/comm_internal.h"

#ifdef HT_NO_MPI /* else comm/mpi.c */

ht_status ht_comm_mpi_init(int *argc, char ***argv, int announced, const char *which, ht_comm **out, ht_error *err) {
    (void)argc, (void)argv;
    *out = ht_comm_single();
    if (announced <= 1) return HT_OK;
    return ht_fail(err, HT_ERR_INVALID,
                   "%s=%d: started as %d processes, but this build has no MPI (cmake -DHT_MPI=OFF): one process only",
                   which, announced, announced);
}

void ht_comm_mpi_set_timeout(double seconds) { (void)seconds; }

#endif /* HT_NO_MPI */
