// test_mpi.h: what a test that may start MPI needs under AddressSanitizer. Open MPI keeps
// allocations from MPI_Init past MPI_Finalize, which LeakSanitizer reports; they are suppressed by
// library, and the slow unwinder sees through Open MPI's frames (built without frame pointers) so
// the suppressions can match them. Included by tests/test_dist.c and tests/test_train_dist.c.
#ifndef VLMOE_TEST_MPI_H
#define VLMOE_TEST_MPI_H
#if defined(__SANITIZE_ADDRESS__)
const char *__asan_default_options(void) { return "fast_unwind_on_malloc=0"; }
const char *__lsan_default_suppressions(void) {
    return "leak:libmpi.so\nleak:libopen-pal.so\nleak:libopen-rte.so\nleak:libhwloc.so\n"
           "leak:libpmix.so\nleak:libevent\nleak:mca_\n";
}
#endif
#endif
