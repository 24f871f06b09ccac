// open.c: picks the process group for a run (src/dist/dist.h): a world of one unless asked for,
// or started by, a multi-process launcher (mpirun, srun, a PMI/PMIx launcher). Covered by
// tests/test_dist.c and tests/test_dist_mpi.sh.
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/core.h"
#include "dist/dist.h"
#include "dist/impl.h"

// The launcher that started this process, from the variables it sets in every process it starts
// (NULL when none did); *size gets the number of processes it started, or 0 when it does not say.
static const char *launcher(long *size) {
    static const struct { const char *name, *rank_var, *size_var; } known[] = {
        {"mpirun (Open MPI)", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"},
        {"a PMI launcher (MPICH's mpiexec, srun --mpi=pmi2)", "PMI_RANK", "PMI_SIZE"},
        {"a PMIx launcher (srun --mpi=pmix, prterun)", "PMIX_RANK", NULL},
        {"srun (Slurm)", "SLURM_PROCID", "SLURM_STEP_NUM_TASKS"},
    };
    for (size_t i = 0; i < sizeof known / sizeof known[0]; i++) {
        if (!getenv(known[i].rank_var)) continue;
        const char *s = known[i].size_var ? getenv(known[i].size_var) : NULL;
        *size = s ? strtol(s, NULL, 10) : 0;
        // a Slurm batch script has SLURM_PROCID and the allocation's SLURM_NTASKS too, but it is
        // one process: only srun's tasks see their step's size, and only several of them launch
        if (!strcmp(known[i].rank_var, "SLURM_PROCID") && *size <= 1) continue;
        return known[i].name;
    }
    *size = 0;
    return NULL;
}

long vlmoe_dist_launched(const char **by) {
    long size = 0;
    const char *who = launcher(&size);
    if (by) *by = who;
    return !who ? 0 : size > 0 ? size : -1;
}

int vlmoe_dist_open(vlmoe_dist **out, const char *kind) {
    *out = NULL;
    if (!kind || !strcmp(kind, "auto")) {
        long size = 0;
        const char *by = launcher(&size);
        if (by && dist_mpi_built()) {
            int st = dist_mpi_open(out);
            // srun without an MPI plugin (a cluster whose default is --mpi=none) starts N
            // processes that each find a world of one: they would each train alone
            if (!st && size > 1 && (*out)->world == 1) {
                vlmoe_dist_close(*out);
                *out = NULL;
                st = vlmoe_fail(VLMOE_ERR_CONFIG, "this process is one of %ld started by %s, but MPI "
                                "found a world of one process: the launcher did not hand its job to MPI, "
                                "so each process would train alone. Under Slurm, run `srun --mpi=pmix` "
                                "(`srun --mpi=list` shows the plugins the cluster has) or mpirun inside "
                                "the allocation", size, by);
            }
            return st;
        }
        // Several copies of a program built without MPI would each train alone and write over
        // each other's checkpoints: refuse rather than run as worlds of one.
        if (by && size != 1) {
            char procs[48] = "processes";
            if (size > 1) snprintf(procs, sizeof procs, "%ld processes", size);
            return vlmoe_fail(VLMOE_ERR_CONFIG, "this process was started by %s (one of %s) but this "
                              "vlmoe was built without MPI; install Open MPI (`apt-get install "
                              "openmpi-bin libopenmpi-dev`) and rebuild with `make clean && make`, or run "
                              "one process without the launcher", by, procs);
        }
        *out = vlmoe_dist_single();
        return VLMOE_OK;
    }
    if (!strcmp(kind, "single")) {
        *out = vlmoe_dist_single();
        return VLMOE_OK;
    }
    if (!strcmp(kind, "mpi")) return dist_mpi_open(out);
    if (!strcmp(kind, "nccl")) return dist_nccl_open(out);
    return vlmoe_fail(VLMOE_ERR_ARG, "unknown distributed backend \"%s\" (expected auto, single, "
                      "mpi or nccl)", kind);
}

int vlmoe_dist_split(vlmoe_dist *d, int color, int key, vlmoe_dist **out) {
    *out = NULL;
    return d->split(d, color, key, out);
}
