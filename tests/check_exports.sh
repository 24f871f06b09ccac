#!/bin/sh
# check_exports.sh: libvlmoe.so must export exactly the functions declared in include/vlmoe.h (the
# library is built with -fvisibility=hidden and the header marks its functions VLMOE_API), and a
# program that knows only that header must link against the shared library and run.
# Fails, naming the symbols, if the .so exports anything else (an internal kernel or helper, or a
# vlmoe_* function the public header does not declare) or if a public function is hidden.
# Run by tests/run.sh as one check of `make test`. Usage: check_exports.sh [LIB.so] [HEADER]
export LC_ALL=C
lib=${1:-libvlmoe.so}; hdr=${2:-include/vlmoe.h}
cc=${CC:-cc}   # left unquoted below on purpose: split into words as make splits $(CC) ("ccache gcc")
[ -f "$lib" ] || { echo "check_exports: $lib not found (run make first)"; exit 1; }
[ -f "$hdr" ] || { echo "check_exports: $hdr not found"; exit 1; }
tmp=$(mktemp -d) || exit 1
trap 'rm -rf "$tmp"' EXIT
status=0

# The functions the header declares: the preprocessor drops comments and macro definitions, so
# every `vlmoe_name(` left is a prototype (the typedef'd callback `(*vlmoe_tokenize_fn)(` is not).
# shellcheck disable=SC2086
$cc -E -P -x c "$hdr" >"$tmp/hdr.i" || { echo "check_exports: cannot preprocess $hdr"; exit 1; }
grep -oE '\bvlmoe_[A-Za-z0-9_]+[[:space:]]*\(' "$tmp/hdr.i" | sed -E 's/[[:space:]]*\($//' |
    sort -u >"$tmp/public"
# The dynamic symbols the library defines. _init, _fini, _edata, _end and __bss_start are made by
# the linker itself (older binutils put them in .dynsym), not by our code.
nm -D --defined-only "$lib" >"$tmp/nm" || { echo "check_exports: nm failed on $lib"; exit 1; }
awk 'NF >= 3 { sub(/@.*/, "", $3); print $3 }' "$tmp/nm" |
    grep -vxE '_init|_fini|_edata|_end|__bss_start' | sort -u >"$tmp/exported"

if [ "$(wc -l <"$tmp/public")" -lt 50 ]; then
    echo "check_exports: found only $(wc -l <"$tmp/public") prototypes in $hdr; is the parsing broken?"
    status=1
fi
if grep -v '^vlmoe_' "$tmp/exported" >"$tmp/internal"; then
    echo "check_exports: $lib exports $(wc -l <"$tmp/internal") symbols outside the vlmoe_ namespace:"
    sed 's/^/    /' "$tmp/internal"
    echo "  (internal functions must stay hidden: the Makefile's -fvisibility=hidden, and no"
    echo "  default-visibility attribute outside $hdr)"
    status=1
fi
comm -13 "$tmp/public" "$tmp/exported" | grep '^vlmoe_' >"$tmp/extra"
if [ -s "$tmp/extra" ]; then
    echo "check_exports: $lib exports vlmoe_ functions that $hdr does not declare:"
    sed 's/^/    /' "$tmp/extra"
    echo "  (declare them in $hdr if they are public API, else drop their VLMOE_API)"
    status=1
fi
comm -23 "$tmp/public" "$tmp/exported" >"$tmp/hidden"
if [ -s "$tmp/hidden" ]; then
    echo "check_exports: $hdr declares functions that $lib does not export:"
    sed 's/^/    /' "$tmp/hidden"
    echo "  (each needs VLMOE_API in $hdr and a definition in the library)"
    status=1
fi

# A user's program: only the public header, only -lvlmoe (the .so's own dependencies are found
# through its RUNPATH), warnings as errors so the header stays clean C11.
cat >"$tmp/user.c" <<'EOF'
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "vlmoe.h"

#define EXPECT(c)                                                     \
    do {                                                              \
        if (!(c)) {                                                   \
            fprintf(stderr, "user.c:%d: %s failed\n", __LINE__, #c); \
            return 1;                                                 \
        }                                                             \
    } while (0)

int main(void) {
    EXPECT(strcmp(vlmoe_status_name(VLMOE_ERR_IO), "i/o error") == 0);
    EXPECT(strcmp(vlmoe_dtype_name(VLMOE_DT_BF16), "BF16") == 0 && vlmoe_dtype_size(VLMOE_DT_BF16) == 2);
    vlmoe_st *st = NULL;
    EXPECT(vlmoe_st_open("/nonexistent/user.safetensors", &st) == VLMOE_ERR_IO);
    EXPECT(strstr(vlmoe_last_error(), "/nonexistent/user.safetensors") != NULL);

    // A forward pass through the tiny model: BLAS, oneDNN and OpenMP reached from inside the .so.
    vlmoe_model_config cfg;
    EXPECT(vlmoe_config_named("tiny", &cfg) == VLMOE_OK);
    vlmoe_synth_params sp = vlmoe_synth_default_params();
    sp.image_size = cfg.image_size;
    vlmoe_synth *s = NULL;
    vlmoe_model *m = NULL;
    EXPECT(vlmoe_synth_init(&s, &sp) == VLMOE_OK);
    EXPECT(vlmoe_model_init(&m, &cfg, 0) == VLMOE_OK);
    static float images[2 * 3 * 64 * 64], emb[2 * 1024];
    EXPECT(cfg.image_size <= 64 && cfg.embed_dim <= 1024);
    size_t img = (size_t)3 * cfg.image_size * cfg.image_size;
    char caption[128];
    int cls;
    for (int i = 0; i < 2; i++)
        EXPECT(vlmoe_synth_sample(s, VLMOE_SPLIT_TRAIN, (uint64_t)i, images + i * img, caption,
                                  sizeof caption, &cls) == VLMOE_OK);
    EXPECT(vlmoe_model_encode_images(m, images, 2, emb) == VLMOE_OK);
    double norm = 0;
    for (int j = 0; j < cfg.embed_dim; j++) norm += (double)emb[j] * emb[j];
    EXPECT(fabs(sqrt(norm) - 1) < 1e-3);
    vlmoe_model_free(m);
    vlmoe_synth_free(s);
    printf("user program: ok (%s)\n", vlmoe_status_name(VLMOE_OK));
    return 0;
}
EOF
libdir=$(cd "$(dirname "$lib")" && pwd)
# shellcheck disable=SC2086
if ! $cc -std=c11 -Wall -Wextra -Wpedantic -Werror -I"$(dirname "$hdr")" "$tmp/user.c" \
        -o "$tmp/user" -L"$libdir" -lvlmoe -lm >"$tmp/cc.log" 2>&1; then
    cat "$tmp/cc.log"
    echo "check_exports: a program using only $hdr does not build against $lib"
    status=1
elif ! readelf -d "$tmp/user" | grep -q 'NEEDED.*\[libvlmoe\.so'; then
    echo "check_exports: the user program was not linked against the shared $lib"
    status=1
elif ! LD_LIBRARY_PATH="$libdir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" "$tmp/user"; then
    echo "check_exports: the user program linked against $lib failed"
    status=1
fi

[ $status -eq 0 ] && echo "check_exports: $lib exports exactly the $(wc -l <"$tmp/public") functions of $hdr"
exit $status
