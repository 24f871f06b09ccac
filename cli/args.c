// args.c: see args.h.
#include "args.h"

#include <errno.h>
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static const char *epilogue; // args_set_epilogue

void args_set_epilogue(const char *text) { epilogue = text; }

void args_help(const char *cmd, const arg_spec *specs, int n, const char *usage) {
    printf("%s\n\nOptions:\n", usage);
    for (int i = 0; i < n; i++) {
        char left[64];
        snprintf(left, sizeof(left), "--%s%s%s", specs[i].name, specs[i].meta ? " " : "",
                 specs[i].meta ? specs[i].meta : "");
        printf("  %-28s %s\n", left, specs[i].help);
    }
    printf("  %-28s %s\n", "-h, --help", "show this help");
    if (epilogue) printf("\n%s\n", epilogue);
    (void)cmd;
}

static int bad_value(const char *cmd, const arg_spec *s, const char *v, const char *range) {
    fprintf(stderr, "vlmoe %s: --%s must be %s, got '%s'\n", cmd, s->name, range, v);
    return 2;
}

static int set_value(const char *cmd, const arg_spec *s, const char *v) {
    char *end;
    errno = 0;
    switch (s->kind) {
    case ARG_INT:
    case ARG_INT1:
    case ARG_LONG:
    case ARG_LONG1: {
        const int is_int = s->kind == ARG_INT || s->kind == ARG_INT1;
        const long long lo = s->kind == ARG_INT1 || s->kind == ARG_LONG1;
        const char *range = lo ? (is_int ? ">= 1 (an integer up to 2147483647)" : ">= 1 (an integer)")
                               : (is_int ? ">= 0 (an integer up to 2147483647)" : ">= 0 (an integer)");
        long long x = strtoll(v, &end, 10);
        if (*end || end == v) {
            fprintf(stderr, "vlmoe %s: --%s expects an integer, got '%s'\n", cmd, s->name, v);
            return 2;
        }
        if (errno || (is_int && x > 2147483647LL) || x < lo || (!is_int && x > LONG_MAX))
            return bad_value(cmd, s, v, range);
        if (is_int) *(int *)s->dest = (int)x;
        else *(long *)s->dest = (long)x;
        return 0;
    }
    case ARG_DOUBLE:
    case ARG_POS:
    case ARG_FRAC:
    case ARG_BETA: {
        double x = strtod(v, &end);
        if (*end || end == v) {
            fprintf(stderr, "vlmoe %s: --%s expects a number, got '%s'\n", cmd, s->name, v);
            return 2;
        }
        const char *range = s->kind == ARG_POS ? "> 0 (a finite number)" : s->kind == ARG_FRAC ? "in [0, 1]"
                            : s->kind == ARG_BETA ? "in [0, 1)" : ">= 0 (a finite number)";
        // errno: ERANGE for an overflow (1e999 -> inf) and also for an underflow to a denormal
        // or 0, which is a fine small number; so the range is checked on the value itself
        if (!isfinite(x) || x < 0 || (s->kind == ARG_POS && x == 0) ||
            (s->kind == ARG_FRAC && x > 1) || (s->kind == ARG_BETA && x >= 1))
            return bad_value(cmd, s, v, range);
        *(double *)s->dest = x;
        return 0;
    }
    case ARG_STRING: *(const char **)s->dest = v; return 0;
    case ARG_FLAG: *(int *)s->dest = 1; return 0;
    }
    return 2;
}

int args_parse_pos(const char *cmd, const arg_spec *specs, int n, int argc, char **argv, int first,
                   const char *usage, char **pos, int maxpos, int *npos) {
    if (npos) *npos = 0;
    for (int i = first; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) {
            args_help(cmd, specs, n, usage);
            return 1;
        }
        for (int k = 0; k < n && !strcmp(a, "-o"); k++)
            if (!strcmp(specs[k].name, "output")) a = "--output";
        if (pos && strncmp(a, "--", 2) && *npos < maxpos) {
            pos[(*npos)++] = argv[i];
            continue;
        }
        if (strncmp(a, "--", 2)) {
            fprintf(stderr, "vlmoe %s: unexpected argument '%s' (flags start with --; see vlmoe %s --help)\n",
                    cmd, a, cmd);
            return 2;
        }
        const char *name = a + 2, *eq = strchr(name, '=');
        size_t len = eq ? (size_t)(eq - name) : strlen(name);
        const arg_spec *s = NULL;
        for (int k = 0; k < n && !s; k++)
            if (strlen(specs[k].name) == len && !strncmp(specs[k].name, name, len)) s = &specs[k];
        if (!s) {
            fprintf(stderr, "vlmoe %s: unknown flag '--%.*s' (see vlmoe %s --help)\n", cmd, (int)len, name, cmd);
            return 2;
        }
        const char *v = NULL;
        if (s->kind == ARG_FLAG) {
            if (eq) {
                fprintf(stderr, "vlmoe %s: --%s takes no value\n", cmd, s->name);
                return 2;
            }
        } else if (eq) {
            v = eq + 1;
        } else if (i + 1 < argc) {
            v = argv[++i];
        } else {
            fprintf(stderr, "vlmoe %s: --%s needs a value (%s)\n", cmd, s->name, s->meta ? s->meta : "");
            return 2;
        }
        if (set_value(cmd, s, v)) return 2;
    }
    return 0;
}

int args_parse(const char *cmd, const arg_spec *specs, int n, int argc, char **argv, int first,
               const char *usage) {
    return args_parse_pos(cmd, specs, n, argc, argv, first, usage, NULL, 0, NULL);
}
