// mpi_stub.c: the MPI process group of a build without libmpi (the Makefile compiles this file in
// place of src/dist/mpi.c when it finds no mpicc, or with MPI=0). It only says how to get the
// real one. Covered by tests/test_dist.c.
#include "core/core.h"
#include "dist/impl.h"

int dist_mpi_built(void) { return 0; }

int dist_mpi_open(vlmoe_dist **out) {
    *out = NULL;
    return vlmoe_fail(VLMOE_ERR_CONFIG, "distributed backend \"mpi\": this vlmoe was built without "
                      "MPI; install Open MPI (`apt-get install openmpi-bin libopenmpi-dev`, or "
                      "scripts/deps.sh) and rebuild with `make clean && make` (MPI=auto finds mpicc)");
}
