# vlmoe build. `make` builds libvlmoe.a, libvlmoe.so and ./vlmoe; `make test` builds and runs every
# test, first as an optimised build and then under AddressSanitizer + UBSan. Missing Debian
# packages are installed by scripts/deps.sh on the first run.
#
# Files in REAL_SRCS are written against the `real` type (src/core/real.h) and compiled twice:
# float for the library's training path and double for the finite-difference gradient checks.

CC      ?= cc
CUDA    ?= 0
comma   := ,
PREFIX  ?= /usr/local
NATIVE  ?= 1
WERROR  ?= $(if $(CI),1,0)
BLASDIR := /usr/lib/x86_64-linux-gnu/openblas-openmp
BLASINC := /usr/include/x86_64-linux-gnu/openblas-openmp

OPT     := -O2 $(if $(filter 1,$(NATIVE)),-march=native,)
WARN    := -Wall -Wextra -Wpedantic -Wshadow -Wno-unused-parameter $(if $(filter 1,$(WERROR)),-Werror,)
# -fno-trapping-math: vlmoe never unmasks floating-point exceptions, so an operation may run where
# its result is then discarded. That is what lets GCC vectorise the loops whose element function
# has a branch (vexp's range checks, the GELU forms) on CPUs without AVX-512's masked operations:
# on AVX2 they ran one element at a time, GELU's epilogue alone 14% of a bench-s step on a Zen 3.
# No value changes (rounding stays IEEE's, unlike -ffast-math, which we never use).
CFLAGS_BASE := -std=c11 -D_POSIX_C_SOURCE=200809L -D_DEFAULT_SOURCE $(WARN) -fopenmp -fPIC \
               -fno-trapping-math -Iinclude -Isrc -I$(BLASINC) -g
# MPI (src/dist/mpi.c, the process group of a run started by mpirun or srun): MPI ?= auto builds
# it when Open MPI's `mpicc --showme` (or `pkg-config ompi`) gives its flags, MPI=1 insists on it,
# MPI=0 compiles src/dist/mpi_stub.c instead, whose error says how to get it. The flags are looked
# up once, after scripts/deps.sh has installed libopenmpi-dev, into build/mpi.mk (make reads it
# again when it is made; delete it to look again). With CUDA=1 and MPI, src/dist/nccl.c too.
MPI     ?= auto
MPI_MK  := build/mpi.mk
ifeq ($(filter clean,$(MAKECMDGOALS)),)
-include $(MPI_MK)
endif
ifeq ($(MPI),1)
ifneq ($(wildcard $(MPI_MK)),)
ifeq ($(strip $(MPI_FOUND_LIBS)),)
$(error MPI=1 but neither `mpicc --showme` nor `pkg-config ompi` finds MPI: install openmpi-bin and libopenmpi-dev, then rm $(MPI_MK))
endif
endif
endif
HAVE_MPI  := $(if $(filter 0,$(MPI)),,$(if $(strip $(MPI_FOUND_LIBS)),1,))
HAVE_NCCL := $(and $(filter 1,$(CUDA)),$(HAVE_MPI))
MPI_LIBS  := $(if $(HAVE_MPI),$(MPI_FOUND_LIBS),)
DIST_SRCS := $(if $(HAVE_MPI),src/dist/mpi.c,src/dist/mpi_stub.c) \
             $(if $(HAVE_NCCL),src/dist/nccl.c,src/dist/nccl_stub.c)
# SentencePiece (src/tok/spm.cc, C++ over Debian's libsentencepiece-dev): SPM ?= auto builds it when
# the header is there, SPM=0 compiles src/tok/spm_stub.c, whose error says how to enable it.
CXX     ?= g++
SPM     ?= auto
HAVE_SPM := $(if $(filter 0,$(SPM)),,$(if $(wildcard /usr/include/sentencepiece_processor.h),1,))
SPM_LIBS := $(if $(HAVE_SPM),-lsentencepiece -lstdc++,)
CXXFLAGS_BASE := -std=c++17 -Wall -Wextra $(if $(filter 1,$(WERROR)),-Werror,) -fPIC -Iinclude -Isrc -g
CUDA_LIBS := $(if $(filter 1,$(CUDA)),-L$(CUDA_HOME)/lib64 -Wl$(comma)-rpath$(comma)$(CUDA_HOME)/lib64 $(if $(HAVE_NCCL),-lnccl,) -lcublas -lcudart -lstdc++,)
LIBS    := $(CUDA_LIBS) $(MPI_LIBS) -L$(BLASDIR) -Wl,-rpath,$(BLASDIR) -lopenblas -ldnnl -lcjson -ljpeg -lpng -lwebp -lpcre2-8 -lutf8proc $(SPM_LIBS) -larchive -lz -lm -fopenmp -lpthread
SAN     := -fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=undefined

REAL_SRCS := $(shell grep -l '^\#include "core/real.h"' src/*/*.c)
# src/cuda: without CUDA=1 the stub, whose error says how to build the real backend; with
# CUDA=1 the .cu files, compiled by nvcc and linked with the CUDA runtime and cuBLAS
NVCC    ?= nvcc
CUDA_HOME ?= /usr/local/cuda
NVCCFLAGS := -std=c++17 -O2 -fmad=false -Xcompiler -fPIC,-Wall -Iinclude -Isrc -I$(BLASINC) \
             -gencode arch=compute_80,code=sm_80 -gencode arch=compute_90,code=sm_90
CUDA_SRCS := $(wildcard src/cuda/*.cu)
PLAIN_SRCS := $(filter-out $(REAL_SRCS) src/cuda/% src/dist/mpi%.c src/dist/nccl%.c $(if $(HAVE_SPM),src/tok/spm_stub.c,),$(wildcard src/*/*.c)) \
              $(if $(filter 1,$(CUDA)),,src/cuda/cuda_stub.c) $(DIST_SRCS)
CLI_SRCS  := $(wildcard cli/*.c)
GEN_TORCH := build/gen/vlmoe_torch_py.c
TEST_SRCS := $(wildcard tests/test_*.c tests/hostile/test_*.c)
HDRS      := $(wildcard include/*.h src/*/*.h tests/*.h cli/*.h)

# $(call objs,builddir): object files of the library for one build flavour
objs = $(patsubst %.c,$(1)/%.o,$(PLAIN_SRCS)) \
       $(patsubst %.c,$(1)/f32/%.o,$(REAL_SRCS)) \
       $(patsubst %.c,$(1)/f64/%.o,$(REAL_SRCS)) \
       $(if $(filter 1,$(CUDA)),$(patsubst %.cu,$(1)/%.o,$(CUDA_SRCS))) \
       $(if $(HAVE_SPM),$(1)/src/tok/spm.o,)

B  := build/rel
BA := build/asan
DEPS_STAMP := build/.deps-ok
TEST_DEPS_STAMP := build/.test-deps-ok

# Library objects are compiled with hidden visibility, so libvlmoe.so exports only what
# include/vlmoe.h marks VLMOE_API: kernels, the graph and internal helpers stay private to it and
# cannot clash with a program's own symbols (tests/check_exports.sh checks the export list under
# `make test`). Visibility means nothing inside a static archive, so the CLI, tests and benches,
# which link libvlmoe.a, still reach every internal function. CLI objects keep the default.
$(call objs,$(B)) $(call objs,$(BA)): LIB_VIS := -fvisibility=hidden
# the AdamW loop's sqrtf vectorises only when it need not set errno (its argument is never
# negative; results are the same bits): one file, not the library (never -ffast-math)
$(B)/f32/src/ops/backend_cpu.o $(BA)/f32/src/ops/backend_cpu.o $(B)/prof/src/ops/backend_cpu.o: CFLAGS += -fno-math-errno
# the headers of the engines src/dist builds on, for its files only
$(B)/src/dist/mpi.o $(BA)/src/dist/mpi.o: SRC_FLAGS := $(MPI_FOUND_CFLAGS)
$(B)/src/dist/nccl.o $(BA)/src/dist/nccl.o build/cuda/dist_nccl.o: SRC_FLAGS := -I$(CUDA_HOME)/include

all: $(DEPS_STAMP) libvlmoe.a libvlmoe.so vlmoe

$(DEPS_STAMP): scripts/deps.sh
	@./scripts/deps.sh build
	@mkdir -p build && touch $@
$(TEST_DEPS_STAMP): scripts/deps.sh
	@./scripts/deps.sh test
	@mkdir -p build && touch $@
$(MPI_MK): $(DEPS_STAMP)
	@mkdir -p $(dir $@)
	@if c=$$(mpicc --showme:compile 2>/dev/null) && l=$$(mpicc --showme:link 2>/dev/null); then :; \
	elif c=$$(pkg-config --cflags ompi 2>/dev/null) && l=$$(pkg-config --libs ompi 2>/dev/null); then :; \
	else c= l=; echo "note: no MPI found (mpicc --showme, pkg-config ompi): src/dist/mpi_stub.c is built"; fi; \
	printf 'MPI_FOUND_CFLAGS := %s\nMPI_FOUND_LIBS := %s\n' "$$c" "$$l" >$@

# The flags a build folder's objects were compiled with, in FOLDER/.flags, rewritten only when
# they change: the objects depend on it, so new flags (an updated Makefile, NATIVE=0, CFLAGS=...)
# rebuild them, where make alone would link the objects of the old ones.
# The lines are expanded here, once, from the global flags: a prerequisite inherits its target's
# target-specific variables (backend_cpu.o's -fno-math-errno), which must not reach the stamp.
FLAGS_REL := $(CC) $(CXX) $(CFLAGS_BASE) $(CXXFLAGS_BASE) $(OPT) $(CFLAGS) $(CXXFLAGS)
FLAGS_ASAN := $(CC) $(CXX) $(CFLAGS_BASE) $(CXXFLAGS_BASE) -O1 $(SAN) $(CFLAGS) $(CXXFLAGS)
$(B)/.flags $(BA)/.flags: FORCE
	@mkdir -p $(dir $@)
	@printf '%s\n' "$(if $(findstring $(BA),$@),$(FLAGS_ASAN),$(FLAGS_REL))" | cmp -s - $@ || \
	 printf '%s\n' "$(if $(findstring $(BA),$@),$(FLAGS_ASAN),$(FLAGS_REL))" >$@
FORCE:

# ---- optimised build
$(B)/%.o: %.c $(HDRS) $(B)/.flags | $(DEPS_STAMP)
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS_BASE) $(OPT) $(LIB_VIS) $(SRC_FLAGS) $(CFLAGS) -c $< -o $@
$(B)/f32/%.o: %.c $(HDRS) $(B)/.flags | $(DEPS_STAMP)
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS_BASE) $(OPT) $(LIB_VIS) $(CFLAGS) -c $< -o $@
$(B)/f64/%.o: %.c $(HDRS) $(B)/.flags | $(DEPS_STAMP)
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS_BASE) $(OPT) $(LIB_VIS) $(CFLAGS) -DVLMOE_REAL_F64 -c $< -o $@

# The C++ shim's own functions (vlmoe_spm_*) stay global; the rest (libstdc++ template copies,
# which its headers give default visibility) is made local, so libvlmoe.so exports no C++.
$(B)/%.o: %.cc $(HDRS) $(B)/.flags | $(DEPS_STAMP)
	@mkdir -p $(dir $@)
	$(CXX) $(CXXFLAGS_BASE) $(OPT) $(LIB_VIS) $(CXXFLAGS) -c $< -o $@
	objcopy -w --keep-global-symbol='vlmoe_spm_*' $@
$(BA)/%.o: %.cc $(HDRS) $(BA)/.flags | $(DEPS_STAMP)
	@mkdir -p $(dir $@)
	$(CXX) $(CXXFLAGS_BASE) -O1 $(SAN) $(LIB_VIS) $(CXXFLAGS) -c $< -o $@
	objcopy -w --keep-global-symbol='vlmoe_spm_*' $@
$(B)/%.o: %.cu $(wildcard src/cuda/*.cuh) $(HDRS) | $(DEPS_STAMP)
	@mkdir -p $(dir $@)
	$(NVCC) $(NVCCFLAGS) -c $< -o $@
$(BA)/%.o: %.cu $(wildcard src/cuda/*.cuh) $(HDRS) | $(DEPS_STAMP)
	@mkdir -p $(dir $@)
	$(NVCC) $(NVCCFLAGS) -c $< -o $@

libvlmoe.a: $(call objs,$(B))
	rm -f $@ && ar rcs $@ $^
libvlmoe.so: $(call objs,$(B))
	$(CC) -shared -o $@ $^ $(LIBS)
vlmoe: $(patsubst %.c,$(B)/%.o,$(CLI_SRCS)) $(B)/$(GEN_TORCH:.c=.o) libvlmoe.a
	$(CC) -o $@ $^ $(LIBS)

# python/vlmoe_torch.py travels inside the program: `vlmoe export --to torch` copies it
$(GEN_TORCH): python/vlmoe_torch.py
	@mkdir -p $(dir $@)
	@{ echo '// generated from python/vlmoe_torch.py by the Makefile'; \
	   echo 'const unsigned char cli_vlmoe_torch_py[] = {'; \
	   od -An -v -tx1 $< | sed 's/\([0-9a-f][0-9a-f]\)/0x\1,/g'; \
	   echo '0};'; echo 'const unsigned long cli_vlmoe_torch_py_len = sizeof(cli_vlmoe_torch_py) - 1;'; } >$@

# ---- sanitizer build (tests only)
$(BA)/%.o: %.c $(HDRS) $(BA)/.flags | $(DEPS_STAMP)
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS_BASE) -O1 $(SAN) $(LIB_VIS) $(SRC_FLAGS) $(CFLAGS) -c $< -o $@
$(BA)/f32/%.o: %.c $(HDRS) $(BA)/.flags | $(DEPS_STAMP)
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS_BASE) -O1 $(SAN) $(LIB_VIS) $(CFLAGS) -c $< -o $@
$(BA)/f64/%.o: %.c $(HDRS) $(BA)/.flags | $(DEPS_STAMP)
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS_BASE) -O1 $(SAN) $(LIB_VIS) $(CFLAGS) -DVLMOE_REAL_F64 -c $< -o $@
$(BA)/libvlmoe.a: $(call objs,$(BA))
	rm -f $@ && ar rcs $@ $^
$(BA)/vlmoe: $(patsubst %.c,$(BA)/%.o,$(CLI_SRCS)) $(BA)/$(GEN_TORCH:.c=.o) $(BA)/libvlmoe.a
	$(CC) $(SAN) -o $@ $^ $(LIBS)

# ---- tests
TESTS      := $(patsubst tests/%.c,$(B)/tests/%,$(TEST_SRCS))
TESTS_ASAN := $(patsubst tests/%.c,$(BA)/tests/%,$(TEST_SRCS))
$(B)/tests/%: tests/%.c libvlmoe.a $(HDRS)
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS_BASE) $(OPT) $(CFLAGS) $< -o $@ libvlmoe.a $(LIBS)
$(BA)/tests/%: tests/%.c $(BA)/libvlmoe.a $(HDRS)
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS_BASE) -O1 $(SAN) $(CFLAGS) $< -o $@ $(BA)/libvlmoe.a $(LIBS)

# ---- fuzzing: libFuzzer targets fuzz/fuzz_*.c over the parsers (CSV, webdataset tar, tokenizer,
# images, safetensors, model configs), built with clang and ASan + UBSan in build/fuzz from the library sources
# they reach. `make fuzz` runs each for FUZZ_TIME seconds; `make test` runs them for FUZZ_TEST_TIME.
FUZZ_CC   ?= clang
FUZZ_TIME ?= 20
FUZZ_TEST_TIME ?= 15
FUZZ_CFLAGS := -std=c11 -D_POSIX_C_SOURCE=200809L -D_DEFAULT_SOURCE $(WARN) -Wno-pass-failed \
               -fopenmp-simd -Iinclude -Isrc -g -O1 $(SAN) -fsanitize=fuzzer-no-link
FUZZ_LIB  := src/core/core.c src/data/readers.c src/data/image.c src/tok/bpe.c src/tok/sentencepiece.c src/tok/spm_stub.c src/io/safetensors.c \
             src/nn/config.c src/nn/sizes.c src/moe/route.c
FUZZ_BINS := $(patsubst fuzz/%.c,build/fuzz/%,$(wildcard fuzz/fuzz_*.c))
FUZZ_SEEDS := build/fuzz/seeds/.stamp
build/fuzz/obj/%.o: %.c $(HDRS) fuzz/fuzz.h | $(TEST_DEPS_STAMP)
	@mkdir -p $(dir $@)
	$(FUZZ_CC) $(FUZZ_CFLAGS) -c $< -o $@
build/fuzz/fuzz_%: build/fuzz/obj/fuzz/fuzz_%.o $(patsubst %.c,build/fuzz/obj/%.o,$(FUZZ_LIB))
	$(FUZZ_CC) $(FUZZ_CFLAGS) -fsanitize=fuzzer -o $@ $^ \
	    -lcjson -ljpeg -lpng -lwebp -lpcre2-8 -lutf8proc -larchive -lz -lm
$(FUZZ_SEEDS): fuzz/seeds.c tests/test_jpeg.h | $(TEST_DEPS_STAMP)
	@mkdir -p build/fuzz/seeds
	$(CC) -std=c11 -D_POSIX_C_SOURCE=200809L $(WARN) -O1 fuzz/seeds.c -o build/fuzz/make_seeds \
	    -larchive -lpng -ljpeg -lwebp
	build/fuzz/make_seeds build/fuzz/seeds && touch $@
fuzz: $(FUZZ_BINS) $(FUZZ_SEEDS)
	@./fuzz/run.sh $(FUZZ_TIME) $(FUZZ_BINS)

# ---- the main job: a small LIMoE on the built-in synthetic data, then its held-out evaluation and
# its report (logs/demo/report.html, also rewritten every 500 steps while it trains)
DEMO_STEPS ?= 3000
demo: all
	rm -rf logs/demo
	./vlmoe train --model limoe-mini --dataset-type synthetic --steps $(DEMO_STEPS) --lr 1e-3 --warmup 150 \
	    --optimizer adamw --wd 0.1 --log-every-n-steps 50 --zeroshot-frequency 500 --eval-samples 500 --report-every 500 --logs logs --name demo
	./vlmoe eval --model logs/demo/checkpoints/step_$(DEMO_STEPS).safetensors
	./vlmoe prune --model logs/demo/checkpoints/step_$(DEMO_STEPS).safetensors --modality text --sweep 1,2,4 \
	    --stats logs/demo/metrics.jsonl
	./vlmoe report logs/demo

# ---- benchmarks (never timed inside tests)
BENCHES := $(patsubst bench/%.c,$(B)/bench/%,$(wildcard bench/bench_*.c))
$(B)/bench/%: bench/%.c libvlmoe.a $(HDRS)
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS_BASE) $(OPT) $(CFLAGS) $< -o $@ libvlmoe.a $(LIBS)

# bench_step_prof: bench_step with the per-op timing hooks (src/core/prof.h) compiled into the
# files that hold them; those objects come before libvlmoe.a, so the archive's plain ones stay out
PROF_SRCS := src/ops/ops.c src/ops/backend_cpu.c
PROF_OBJS := $(patsubst %.c,$(B)/prof/%.o,$(PROF_SRCS))
$(B)/prof/%.o: %.c $(HDRS) $(B)/.flags | $(DEPS_STAMP)
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS_BASE) $(OPT) $(CFLAGS) -DVLMOE_PROFILE -c $< -o $@
$(B)/bench/bench_step_prof: bench/bench_step.c $(PROF_OBJS) libvlmoe.a $(HDRS)
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS_BASE) $(OPT) $(CFLAGS) -DVLMOE_PROFILE $< $(PROF_OBJS) -o $@ libvlmoe.a $(LIBS)

# bench_step, bench_sgemm, bench_peak and bench_int8 are the C halves of bench/speed.py (vlmoe against PyTorch)
bench: all $(BENCHES) $(B)/bench/bench_step_prof $(TEST_DEPS_STAMP)
	@for b in $(filter-out %/bench_step %/bench_sgemm %/bench_peak %/bench_int8 %/bench_dist %/bench_loader_dist,$(BENCHES)); do echo "== $$b"; $$b || exit 1; done
	@echo "== bench/speed.py" && /usr/bin/python3 bench/speed.py --bin $(B)/bench
	@echo "== bench/limoe_failure.sh" && ./bench/limoe_failure.sh
	@echo "== bench/dense_vs_limoe.sh" && ./bench/dense_vs_limoe.sh
	@echo "== bench/vlmoe_vs_mome.sh" && ./bench/vlmoe_vs_mome.sh
	@echo "== bench/dist.sh" && ./bench/dist.sh $(B)/bench

# CI has no GPU but has nvcc: `make test` compiles src/cuda and links tests/test_backend_ops
# against it (build/cuda), so the CUDA code cannot rot; without a device its CUDA rows skip.
# Without nvcc on PATH this step is left out with a message.
HAVE_NVCC := $(shell command -v $(NVCC) >/dev/null 2>&1 && echo 1)
CUDA_CHECK := $(if $(HAVE_NVCC),build/cuda/tests/test_backend_ops,)
CUDA_CHECK_OBJS := $(patsubst src/cuda/%.cu,build/cuda/%.o,$(CUDA_SRCS))
build/cuda/%.o: src/cuda/%.cu $(wildcard src/cuda/*.cuh) $(HDRS) | $(DEPS_STAMP)
	@mkdir -p $(dir $@)
	$(NVCC) $(NVCCFLAGS) -c $< -o $@
build/cuda/tests/test_backend_ops: tests/test_backend_ops.c $(CUDA_CHECK_OBJS) libvlmoe.a $(HDRS)
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS_BASE) $(OPT) $(CFLAGS) $< -o $@ $(CUDA_CHECK_OBJS) libvlmoe.a \
	    -L$(CUDA_HOME)/lib64 -Wl,-rpath,$(CUDA_HOME)/lib64 -lcublas -lcudart -lstdc++ $(LIBS)
# src/dist/nccl.c (needs MPI for its bootstrap) is compiled the same way and linked into
# tests/test_dist, whose NCCL checks skip without a device.
ifneq ($(HAVE_MPI),)
CUDA_CHECK += $(if $(HAVE_NVCC),build/cuda/tests/test_dist,)
endif
build/cuda/dist_nccl.o: src/dist/nccl.c $(HDRS) $(B)/.flags | $(DEPS_STAMP)
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS_BASE) $(OPT) $(SRC_FLAGS) $(CFLAGS) -c $< -o $@
build/cuda/tests/test_dist: tests/test_dist.c build/cuda/dist_nccl.o $(CUDA_CHECK_OBJS) libvlmoe.a $(HDRS)
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS_BASE) $(OPT) $(CFLAGS) $< -o $@ build/cuda/dist_nccl.o $(CUDA_CHECK_OBJS) libvlmoe.a \
	    -L$(CUDA_HOME)/lib64 -Wl,-rpath,$(CUDA_HOME)/lib64 -lnccl -lcublas -lcudart -lstdc++ $(LIBS)
cuda-check: $(CUDA_CHECK)

FIXTURES := build/fixtures/.stamp
$(FIXTURES): $(wildcard tests/ref/*.py) | $(TEST_DEPS_STAMP)
	@mkdir -p build/fixtures
	/usr/bin/python3 tests/ref/gen_all.py build/fixtures
	@touch $@

# the benchmarks are built too (not run: that is `make bench`), so they cannot rot unseen
test: all $(TESTS) $(TESTS_ASAN) $(BA)/vlmoe $(FIXTURES) $(FUZZ_BINS) $(FUZZ_SEEDS) $(CUDA_CHECK) $(BENCHES) \
      $(B)/bench/bench_step_prof
	@$(if $(HAVE_NVCC),,echo "note: $(NVCC) not found: the CUDA backend was not compiled")
	@VLMOE_SO=libvlmoe.so CUDADIR=$(if $(HAVE_NVCC),build/cuda,) FUZZ_TIME=$(FUZZ_TEST_TIME) ./tests/run.sh "$(B)" "$(BA)" ./vlmoe $(BA)/vlmoe build/fuzz

fixtures: $(FIXTURES)

install: all
	install -d $(DESTDIR)$(PREFIX)/lib $(DESTDIR)$(PREFIX)/include $(DESTDIR)$(PREFIX)/bin \
	           $(DESTDIR)$(PREFIX)/lib/pkgconfig
	install -m 644 libvlmoe.a libvlmoe.so $(DESTDIR)$(PREFIX)/lib/
	install -m 644 include/vlmoe.h $(DESTDIR)$(PREFIX)/include/
	install -m 755 vlmoe $(DESTDIR)$(PREFIX)/bin/
	sed -e 's|@PREFIX@|$(PREFIX)|' -e 's|@VERSION@|0.1.0|' -e 's|@BLASDIR@|$(BLASDIR)|' \
	    vlmoe.pc.in > $(DESTDIR)$(PREFIX)/lib/pkgconfig/vlmoe.pc

clean:
	rm -rf build/rel build/asan build/cuda build/fixtures build/fuzz $(MPI_MK) libvlmoe.a libvlmoe.so vlmoe

.PHONY: all test fixtures install clean bench demo fuzz cuda-check FORCE
.SECONDARY:
