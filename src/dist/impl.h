// impl.h: the implementations behind vlmoe_dist_open (src/dist/open.c), each in its own file the
// Makefile swaps for a stub when its engine is not built in: mpi.c or mpi_stub.c (libmpi found
// by the Makefile), nccl.c or nccl_stub.c (CUDA=1 and MPI). Internal to src/dist.
#ifndef VLMOE_DIST_IMPL_H
#define VLMOE_DIST_IMPL_H
#include "dist/dist.h"

// 1 when this build has MPI (src/dist/mpi.c), 0 in the stub
int dist_mpi_built(void);
// A process group over MPI_COMM_WORLD; initialises MPI unless the program already has. The stub
// fails with an error saying how to build it.
int dist_mpi_open(vlmoe_dist **out);
// A process group over NCCL on this rank's GPU (local_rank modulo the visible devices),
// bootstrapped by dist_mpi_open. The stub fails with an error saying how to build it.
int dist_nccl_open(vlmoe_dist **out);

#endif
