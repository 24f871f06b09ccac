"""test_speed_logs.py: bench/speed.py's reading of the kernel logs (verbose_counts) on lines as
oneDNN 2.x (Debian's), oneDNN 3.x (PyTorch's wheels: a version field before "exec") and oneMKL
print them. Counts only matrix products, never info, template or reorder lines. Prints one line
"test_speed_logs: N passed, N failed" and exits non-zero on a failure.
Usage: /usr/bin/python3 tests/py/test_speed_logs.py"""
from checks import check as check_ok, done  # first: it puts bench/ on the path
import speed

# oneMKL's instruction set, as its first line names it
ISA = ("Intel(R) Advanced Vector Extensions 512 (Intel(R) AVX-512) with support for INT8, BF16, FP16 (limited) "
       "instructions, and Intel(R) Advanced Matrix Extensions (Intel(R) AMX) with INT8 and BF16")
LOG = [
    "onednn_verbose,info,oneDNN v2.6.3 (commit N/A)",
    "onednn_verbose,info,prim_template:operation,engine,primitive,implementation,prop_kind,memory_descriptors,"
    "attributes,auxiliary,problem_desc,exec_time",
    "onednn_verbose,exec,cpu,matmul,brg:avx512_core_amx_bf16,undef,src_bf16::blocked:ab:f0,,,512x192:192x256,0.22",
    "onednn_verbose,exec,cpu,matmul,brg:avx512_core_amx_bf16,undef,src_bf16::blocked:ab:f0,,,512x192:192x256,0.21",
    "onednn_verbose,v1,info,cpu,isa:Intel AVX10.1 and Intel AMX with bfloat16 and 8-bit integer support",
    "onednn_verbose,v1,primitive,info,template:operation,engine,primitive,implementation,prop_kind,"
    "memory_descriptors,attributes,auxiliary,problem_desc,exec_time",
    "onednn_verbose,v1,primitive,exec,cpu,matmul,brg_matmul:avx10_1_512_amx,undef,src:bf16::blocked:ab::f0,"
    "attr-scratchpad:user,,4096x256:256x768,3.76",
    "onednn_verbose,v1,primitive,exec,cpu,reorder,jit:uni,undef,src:bf16::blocked:abcd::f0,,,64x3x64x64,0.24",
    "onednn_verbose,1732760000.123,primitive,exec,cpu,inner_product,brgemm:avx512_core_amx,forward_training,"
    "src:f32,,,mb64ic256oc256,0.5",
    "MKL_VERBOSE oneMKL 2024.0 Update 2 Product build 20240605 for Intel(R) 64 architecture " + ISA
    + ", Lnx 2.60GHz lp64 gnu_thread",
    "MKL_VERBOSE SGEMM(T,N,768,4096,256,0x7fff68e0da30,0x55b933bd4d00,256,0x55b93a0d51c0,256,0x7fff68e0da50,"
    "0x7f7b93424040,768) 56.18ms CNR:OFF Dyn:0 FastMM:1 TID:0  NThr:1",
    "MKL_VERBOSE SGEMM(N,N,256,4096,768,0x7fff68e0da30,0x55b933bd4d00,256,0x55b93a0d51c0,256,0x7fff68e0da50,"
    "0x7f7b93424040,768) 6.1ms CNR:OFF Dyn:0 FastMM:1 TID:0  NThr:1",
    "MKL_VERBOSE SGEMM_BATCH(N,N,0x7fff68e0dfc8,0x7fff68e0dfc4) 1.2ms CNR:OFF Dyn:0 FastMM:1 TID:0  NThr:1",
    "MKL_VERBOSE GEMM_BF16BF16F32(T,N,16,16,64,0x7ffcc3595dd0,0x5585aa5e2740,16384) 474.62us CNR:OFF Dyn:0 NThr:1",
    '{"impl": "torch"}',
]


def check(what, got, want):
    check_ok(what, got == want, f"got {got!r}, want {want!r}")


onednn, mkl, isa = speed.verbose_counts(LOG)
check("oneDNN products", onednn, {"matmul:brg:avx512_core_amx_bf16": 2, "matmul:brg_matmul:avx10_1_512_amx": 1,
                                  "inner_product:brgemm:avx512_core_amx": 1})
check("oneMKL calls", mkl, {"SGEMM": 2, "SGEMM_BATCH": 1, "GEMM_BF16BF16F32": 1})
check("oneMKL's instruction set", isa, ISA)
check("a log without products", speed.verbose_counts(LOG[:2] + LOG[4:6] + LOG[-1:]), ({}, {}, None))
done("test_speed_logs")
