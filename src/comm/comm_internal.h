/* Inside comm/: the MPI world behind ht_comm_init. */
#ifndef HT_COMM_INTERNAL_H
#define HT_COMM_INTERNAL_H

#include "hypertrain/comm.h"

/* Initialises MPI for a process a launcher started (`announced` ranks, as its
 * environment variable `which` says) and makes *out the world. */
ht_status ht_comm_mpi_init(int *argc, char ***argv, int announced, const char *which, ht_comm **out, ht_error *err);
void ht_comm_mpi_set_timeout(double seconds);

#endif
