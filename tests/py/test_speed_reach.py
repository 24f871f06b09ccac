"""test_speed_reach.py: bench/speed.py's fp32_reach, on numbers worked by hand (this Xeon's run of
2026-11-28 at 1 thread: 151.5 GFLOP a step, FMA peak 246 GFLOP/s, SGEMM at the model's shapes
OpenBLAS 175 and oneDNN 183, PyTorch's fp32 step 1.537 s): the fastest library is the one taken,
vlmoe's own product included where it is measured; the 75%-of-peak step is 151.5 / (0.75 x 246)
= 0.8211 s and the products alone 151.5 / 183 = 0.8279 s, so the rest would have to take
-0.0067 s; 1.5x PyTorch is a 1.0247 s step, 0.1968 s left. No rate, no answer. Prints one line
"test_speed_reach: N passed, N failed" and exits non-zero on a failure.
Usage: /usr/bin/python3 tests/py/test_speed_reach.py"""
from checks import check, done  # first: it puts bench/ on the path
import speed


def near(x, y):
    return abs(x - y) < 5e-5


r = speed.fp32_reach(151.5, 246, {"openblas_gflops": 175, "onednn_gflops": 183}, 1.537)
check("the fastest library", r["library"] == "oneDNN" and r["gflops"] == 183, r)
check("products alone 0.8279 s", near(r["products_s"], 0.827869), r)
check("75%-of-peak step 0.8211 s", near(r["peak_step_s"], 0.821138), r)
check("75%-of-peak: 0.0067 s short", near(r["peak_left_s"], -0.006731), r)
check("1.5x PyTorch step 1.0247 s", near(r["torch_step_s"], 1.024667), r)
check("1.5x PyTorch: 0.1968 s left", near(r["torch_left_s"], 0.196798), r)

# round numbers of an AVX2 machine's kind (not a measurement), where vlmoe's own product is the fastest
r = speed.fp32_reach(151.5, 94, {"openblas_gflops": 52, "onednn_gflops": 55, "vlmoe_avx2_gflops": 70}, 3.2)
check("vlmoe's own product when fastest", r["library"] == "vlmoe's AVX2 product" and r["gflops"] == 70, r)
check("its products alone 2.1643 s", near(r["products_s"], 2.164286), r)
check("its 75%-of-peak step 2.1489 s", near(r["peak_step_s"], 2.148936), r)
check("its 1.5x PyTorch step: 0.031 s short", near(r["torch_left_s"], 2.133333 - 2.164286), r)

check("no rate measured: None", speed.fp32_reach(151.5, 246, {"openblas_gflops": None}, 1.5) is None)
check("no rate at all: None", speed.fp32_reach(151.5, 246, {}, 1.5) is None)
# two readings of the rates (before and after the rounds): the higher of each kept
sg = {"openblas_gflops": 175, "onednn_gflops": 150}
speed.keep_higher(sg, {"openblas_gflops": 160, "onednn_gflops": 183}, [k for k, _ in speed.SGEMM_RATES])
check("keep_higher: the higher of two readings", sg["openblas_gflops"] == 175 and sg["onednn_gflops"] == 183, sg)
check("keep_higher: 0 where neither reading has it", sg["vlmoe_avx2_gflops"] == 0, sg)
done("test_speed_reach")
