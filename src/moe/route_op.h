// route_op.h: the route entry of the CPU tables (be_route in src/ops/backend.h): route.c's
// decision per group and the packed row layout, on host memory. The reference the CUDA route
// (src/cuda/route_cuda.cu) matches bit for bit. Covered by tests/test_route_op.c.
#ifndef VLMOE_MOE_ROUTE_OP_H
#define VLMOE_MOE_ROUTE_OP_H
#include "ops/backend.h"

// gates (n,E) by activation row; everything in r and o is host memory.
int route_host_f32(const float *gates, const be_route *r, const be_route_out *o);
int route_host_f64(const double *gates, const be_route *r, const be_route_out *o);

#endif
