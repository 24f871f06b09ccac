// watchdog.h: the collective timeout of src/dist, like torch.distributed's timeout and NCCL's
// watchdog: a thread that notices when one collective has run longer than the timeout (a peer
// stopped or hung) and calls the owner's fire function. Internal to src/dist (mpi.c uses it);
// covered by tests/test_dist.c (timing, with a fire function that records) and, under mpirun,
// tests/test_dist_mpi.sh (a rank that hangs).
#ifndef VLMOE_DIST_WATCHDOG_H
#define VLMOE_DIST_WATCHDOG_H
#include <stddef.h>
#include <stdint.h>

// The timeout when neither --dist-timeout nor VLMOE_DIST_TIMEOUT says: torch.distributed's
// default for NCCL (10 minutes), far above any collective of a healthy run.
#define DIST_TIMEOUT_DEFAULT 600.0

typedef struct dist_watchdog dist_watchdog;
// Called from the watchdog's thread when the collective begun as `seq` (what, group as given to
// dist_watchdog_begin) has waited `waited` seconds, once per collective; when it returns, the
// watchdog goes on watching.
typedef void (*dist_watchdog_fire)(void *user, uint64_t seq, const char *what, const void *group, double waited);

// A watchdog polling every poll_s seconds, with no timeout until one is set.
int dist_watchdog_start(dist_watchdog **out, double poll_s, dist_watchdog_fire fire, void *user);
// seconds > 0: the longest a collective may run; 0: no limit. Any thread, any time.
void dist_watchdog_set_timeout(dist_watchdog *w, double seconds);
double dist_watchdog_get_timeout(const dist_watchdog *w);
// Around every collective, on the thread that calls it: two atomic stores and a clock read each,
// nothing the common path can measure. NULL-safe.
void dist_watchdog_begin(dist_watchdog *w, const char *what, const void *group);
void dist_watchdog_end(dist_watchdog *w);
// Whether the collective begun as seq is still running (the fire function's check that its group
// is still alive while it reads it).
int dist_watchdog_running(const dist_watchdog *w, uint64_t seq);
// Stops and joins the thread; NULL-safe.
void dist_watchdog_stop(dist_watchdog *w);

// "rank R: WHAT has waited N s for the other processes (one of ranks A, B, ... may have stopped or
// hung): aborting the job" into buf (n): "rank A" for one other, "another process" for none
// known, a long list cut with "...".
void dist_timeout_message(char *buf, size_t n, int rank, const char *what, double waited, const int *others,
                          int n_others);
// Hands a timeout's message to the handler of vlmoe_dist_on_timeout (dist.h), if one is set.
void dist_timeout_report(const char *message);
// seconds >= 0 from a flag or VLMOE_DIST_TIMEOUT ("600", "2.5", "0"); -1 on anything else.
int dist_timeout_parse(const char *s, double *out);

#endif
