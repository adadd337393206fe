/* libnccl.so.2 for the emulated device: the symbols comm/nccl.cu
 * opens, each aborting if called. An NCCL group of one process never calls
 * NCCL (its collectives are the backend's copies), so test_dist_emu
 * --nccl-rank runs that group's every collective on the host, and a call
 * that reaches NCCL there is a failure that names itself. */
#include <stdio.h>
#include <stdlib.h>

#define NOT_HERE(name)                                                                                                 \
    int name(void) {                                                                                                   \
        fprintf(stderr, "nccl_stub: " #name " called in a group of one process\n");                                    \
        abort();                                                                                                       \
    }
NOT_HERE(ncclGetUniqueId)
NOT_HERE(ncclCommInitRank)
NOT_HERE(ncclCommDestroy)
NOT_HERE(ncclCommAbort)
NOT_HERE(ncclGroupStart)
NOT_HERE(ncclGroupEnd)
NOT_HERE(ncclSend)
NOT_HERE(ncclRecv)
NOT_HERE(ncclAllReduce)
NOT_HERE(ncclBroadcast)

const char *ncclGetErrorString(int result);
const char *ncclGetErrorString(int result) {
    (void)result;
    return "nccl_stub: no NCCL here";
}
