// test_hostile_files.c: what a careless user, a crash or a full disk does to a run's files (issue 19):
// outputs named like inputs (through other spellings and hard links), SIGKILLs at random instants
// across checkpoint writes followed by `--resume latest`, damaged and mismatched checkpoint pairs,
// one flipped byte anywhere in a checkpoint's tensor data, and a file-size limit (RLIMIT_FSIZE, the
// portable stand-in for a full disk) hitting metrics.jsonl and a checkpoint. Every case asserts the
// clean error and that no input changed. VLMOE_HOSTILE_KILLS sets the number of kills (default 200,
// 50 in the ASan build) and VLMOE_HOSTILE_FLIPS the flipped bytes per file (default 64, 12 in ASan).
#include <cjson/cJSON.h>
#include <dirent.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/time.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "../test.h"
#include "vlmoe.h"

static char bin_buf[4096], root[256];
static const char *bin; // the vlmoe binary under test
static char out[1 << 16];

// The training run every case uses: a tiny dense model, a checkpoint after every step, all kept.
#define STEPS 4
#define RUN "train --model tiny --batch-size 4 --steps 4 --save-every-n-steps 1 --keep-checkpoints 0 " \
            "--log-every-n-steps 1 --eval-samples 0 --threads 1 --logs logs"

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

// FNV-1a of a file's bytes; 0 for a file that cannot be read.
static uint64_t file_sum(const char *path) {
    size_t n;
    char *b = test_read_file(path, &n);
    if (!b) return 0;
    uint64_t h = 1469598103934665603ull;
    for (size_t i = 0; i < n; i++) h = (h ^ (unsigned char)b[i]) * 1099511628211ull;
    free(b);
    return h;
}

static int sh(const char *fmt, const char *a, const char *b) {
    char cmd[2048];
    snprintf(cmd, sizeof(cmd), fmt, a, b);
    return system(cmd);
}

// A fresh copy of folder from at to (what was there is removed).
static void copy_dir(const char *from, const char *to) {
    char cmd[1200];
    snprintf(cmd, sizeof(cmd), "rm -rf %s && cp -r %s %s", to, from, to);
    CHECK(system(cmd) == 0, "%s", cmd);
}

static int exists(const char *path) {
    struct stat sb;
    return stat(path, &sb) == 0;
}

// 1 when the two model files hold the same tensors with the same bytes (metadata aside: run and
// save ids differ between runs); else 0 with the first difference printed.
static int same_tensors(const char *a, const char *b) {
    vlmoe_st *x = NULL, *y = NULL;
    int same = !vlmoe_st_open(a, &x) && !vlmoe_st_open(b, &y) && vlmoe_st_count(x) == vlmoe_st_count(y);
    for (int i = 0; same && i < vlmoe_st_count(x); i++) {
        vlmoe_tensor_info p, q;
        vlmoe_st_info(x, i, &p);
        const int j = vlmoe_st_find(y, p.name);
        same = j >= 0 && !vlmoe_st_info(y, j, &q) && p.nbytes == q.nbytes && !memcmp(p.data, q.data, p.nbytes);
        if (!same) fprintf(stderr, "tensor '%s' differs between %s and %s\n", p.name, a, b);
    }
    if (!x || !y) fprintf(stderr, "cannot compare %s and %s: %s\n", a, b, vlmoe_last_error());
    vlmoe_st_close(x), vlmoe_st_close(y);
    return same;
}

// metrics.jsonl without the wall-clock "time" object of each record, which is all that may differ
// between a resumed and an uninterrupted run.
static char *metrics_text(const char *dir) {
    char *m = test_read_file(test_path(dir, "logs/r/metrics.jsonl"), NULL);
    if (!m) return NULL;
    char *w = m;
    for (char *r = m; *r;) {
        char *t = strstr(r, ",\"time\":{");
        char *nl = strchr(r, '\n');
        if (t && (!nl || t < nl)) { // copy up to the field, then skip to the record's closing brace
            memmove(w, r, (size_t)(t - r));
            w += t - r;
            r = strchr(t, '}');
            r = r ? r + 1 : t + strlen(t);
        } else {
            const size_t k = nl ? (size_t)(nl - r + 1) : strlen(r);
            memmove(w, r, k);
            w += k, r += k;
        }
    }
    *w = 0;
    return m;
}

// The run folder dir/logs/r after training to STEPS equals the reference's: final weights, and
// every metrics record of steps 1..STEPS once, bit for bit.
static int same_as_reference(const char *dir, const char *refdir) {
    char a[600], b[600];
    snprintf(a, sizeof(a), "%s/logs/r/checkpoints/step_%d.safetensors", dir, STEPS);
    snprintf(b, sizeof(b), "%s/logs/r/checkpoints/step_%d.safetensors", refdir, STEPS);
    char *m = metrics_text(dir), *r = metrics_text(refdir);
    const int same_m = m && r && !strcmp(m, r);
    if (!same_m) fprintf(stderr, "metrics differ:\n%s\n--- reference:\n%s\n", m ? m : "(none)", r ? r : "(none)");
    free(m), free(r);
    return same_tensors(a, b) && same_m;
}

// ---- 1. outputs that name an input
static void outputs_vs_inputs(const char *refdir) {
    char d[400];
    snprintf(d, sizeof(d), "%s/outputs", root);
    mkdir(d, 0755);
    CHECK(sh("cp %s/logs/r/checkpoints/step_4.safetensors %s/model.safetensors", refdir, d) == 0, "copy model");
    test_write_file(test_path(d, "caps.txt"), "a red square\na blue circle\na red circle\n", 41);
    CHECK(link(test_path(d, "model.safetensors"), test_path(d, "hard.safetensors")) == 0, "hard link");
    mkdir(test_path(d, "sub"), 0755);
    test_write_file(test_path(d, "caps.labels"), "a red square\tred\n", 17);
    const char *ins[] = {"model.safetensors", "caps.txt", "caps.labels"};
    uint64_t before[3];
    for (int i = 0; i < 3; i++) before[i] = file_sum(test_path(d, ins[i]));
    static const struct { const char *args, *needle; } cases[] = {
        {"embed --model model.safetensors --texts caps.txt -o model.safetensors", "same file as --model"},
        {"embed --model model.safetensors --texts caps.txt -o sub/../model.safetensors", "same file as --model"},
        {"embed --model model.safetensors --texts caps.txt -o hard.safetensors", "same file as --model"},
        {"embed --model model.safetensors --texts caps.txt -o caps.txt", "same file as --texts"},
        {"tokenizer train --captions caps.txt --vocab-size 600 -o caps.txt", "same file as --captions"},
        {"tokenizer train --captions caps.txt --vocab-size 600 -o ./sub/../caps.txt", "same file as --captions"},
        {"export --model model.safetensors --to openclip -o hard.safetensors", "same file as --model"},
        {"import model.safetensors -o model.safetensors", "same file as the input"},
        // a folder's files: import DIR reads DIR/model.safetensors, export --to DIR --force writes it
        {"import . -o model.safetensors", "same file as the input folder's ./model.safetensors"},
        {"export --model model.safetensors --to torch . --force", "the folder's ./model.safetensors is the same file"},
        {"prune --model model.safetensors --modality image --keep 1 -o model.safetensors", "same file as --model"},
        {"soup model.safetensors hard.safetensors -o hard.safetensors", "same file as the checkpoint"},
        {"upcycle model.safetensors -o model.safetensors", "same file as the input"},
        {"vq train --size 4 --model model.safetensors -o model.safetensors", "same file as --model"},
        {"finetune --model model.safetensors --task text-cls --data caps.txt -o caps.txt", "same file as --data"},
        {"finetune --model model.safetensors --task text-cls --data caps.labels -o caps", "(its .labels file) caps.labels"},
        {"caption --model model.safetensors --data caps.txt -o caps.txt", "same file as --data"},
        {"caption --model model.safetensors --data caps.txt -o hard.safetensors", "same file as --model"},
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++)
        test_expect_in(d, bin, cases[i].args, 1, cases[i].needle, out, sizeof(out));
    // a run folder whose config.json is given back as --model
    mkdir(test_path(d, "logs"), 0755);
    CHECK(sh("cp -r %s/logs/r %s/logs/r", refdir, d) == 0, "copy run");
    const uint64_t cfg = file_sum(test_path(d, "logs/r/config.json"));
    test_expect_in(d, bin, "train --model logs/r/config.json --name r --logs logs --steps 1 --eval-samples 0", 1,
                   "the run's file logs/r/config.json is the same file as --model", out, sizeof(out));
    CHECK(file_sum(test_path(d, "logs/r/config.json")) == cfg, "config.json changed");
    for (int i = 0; i < 3; i++) CHECK(file_sum(test_path(d, ins[i])) == before[i], "%s changed", ins[i]);
    // the check refuses only what it must: a new output next to the inputs is written
    test_expect_in(d, bin, "embed --model model.safetensors --texts caps.txt -o new.safetensors", 0, "-> new.safetensors",
                   out, sizeof(out));
}

// ---- 2. SIGKILL at random instants across checkpoint writes, then --resume latest
// The name of a temporary checkpoint file in dir's checkpoints folder (a write under way), or "".
static void tmp_name(const char *dir, char *name, size_t cap) {
    DIR *d = opendir(test_path(dir, "logs/r/checkpoints"));
    struct dirent *e;
    name[0] = 0;
    while (d && (e = readdir(d)))
        if (strstr(e->d_name, ".tmp.")) snprintf(name, cap, "%s", e->d_name);
    if (d) closedir(d);
}

// Starts `vlmoe ARGS` in dir and SIGKILLs it, unless it ended first (then 0): after `delay`
// seconds, or, with nth > 0, `delay` seconds after the nth temporary checkpoint file it starts to
// write (each save writes two, the state's then the weights'), so that kills land inside saves.
static int run_and_kill(const char *dir, const char *args, double delay, int nth) {
    char cmd[4096];
    snprintf(cmd, sizeof(cmd), "cd %s && exec %s %s >/dev/null 2>&1", dir, bin, args);
    const pid_t pid = fork();
    if (pid == 0) {
        execl("/bin/sh", "sh", "-c", cmd, (char *)NULL);
        _exit(127);
    }
    int status = 0, seen = 0;
    char last[256] = "", name[256];
    const struct timespec poll = {0, 50000};
    while (seen < nth) { // watch the folder for new temporary files
        if (waitpid(pid, &status, WNOHANG) == pid) return 0;
        tmp_name(dir, name, sizeof(name));
        if (name[0] && strcmp(name, last)) seen++, snprintf(last, sizeof(last), "%s", name);
        nanosleep(&poll, NULL);
    }
    const struct timespec ts = {(time_t)delay, (long)((delay - (double)(time_t)delay) * 1e9)};
    nanosleep(&ts, NULL);
    const int killed = waitpid(pid, &status, WNOHANG) == 0;
    if (killed) kill(pid, SIGKILL);
    if (killed) waitpid(pid, &status, 0);
    return killed;
}

// What a kill left in dir/logs/r/checkpoints: temporary files, state files without weights, pairs.
static void census(const char *dir, int *tmp, int *orphan, int *pairs, int *newest) {
    DIR *d = opendir(test_path(dir, "logs/r/checkpoints"));
    *tmp = *orphan = *pairs = *newest = 0;
    struct dirent *e;
    while (d && (e = readdir(d))) {
        long s;
        char tail[64], w[700];
        if (strstr(e->d_name, ".tmp.")) ++*tmp;
        else if (sscanf(e->d_name, "step_%ld%63s", &s, tail) == 2 && !strcmp(tail, ".state.safetensors")) {
            snprintf(w, sizeof(w), "%s/logs/r/checkpoints/step_%ld.safetensors", dir, s);
            if (exists(w)) ++*pairs, *newest = s > *newest ? (int)s : *newest;
            else ++*orphan;
        }
    }
    if (d) closedir(d);
}

static void kill_test(const char *refdir, double t_run, int kills) {
    char d[400];
    snprintf(d, sizeof(d), "%s/kill", root);
    srand(1234);
    int done = 0, chains = 0, no_ckpt = 0, with_tmp = 0, with_orphan = 0, finished_early = 0, ok = 1;
    const double t0 = now();
    while (done < kills && ok) {
        sh("rm -rf %s && mkdir -p %s", d, d);
        chains++;
        // a chain: up to 4 kills, each followed by --resume latest, then one resume that completes
        int started = 0;
        for (int k = 0; k < 4 && done < kills; k++) {
            // every other kill at a uniform instant of the run, the others inside a save: at a
            // uniform instant of the 2 ms after one of the temporary files a run writes starts
            // save the run still has to write (a resumed run starts at the newest complete pair)
            int tmp, orphan, pairs, newest;
            census(d, &tmp, &orphan, &pairs, &newest);
            const int left = STEPS - newest, inside = done % 2;
            if (left <= 0) break; // the last checkpoint is written: nothing left to interrupt
            const double u = (double)rand() / RAND_MAX;
            const double delay = inside ? 0.002 * u : t_run * u * (1 + left) / (1 + STEPS);
            const int nth = inside ? 1 + rand() % (2 * left) : 0;
            started = started || exists(test_path(d, "logs/r"));
            if (!run_and_kill(d, started ? RUN " --name r --resume latest" : RUN " --name r", delay, nth)) {
                finished_early++;
                if (!inside) t_run *= 0.8; // the reference's time was a slow moment of a shared machine
                break;
            }
            done++;
            census(d, &tmp, &orphan, &pairs, &newest);
            no_ckpt += pairs == 0, with_tmp += tmp > 0, with_orphan += orphan > 0;
        }
        // the run folder may not exist yet if the first kill came before the run made it
        const int st = test_run_in(d, bin, exists(test_path(d, "logs/r")) ? RUN " --name r --resume latest"
                                                                            : RUN " --name r", 1, out, sizeof(out));
        CHECK(st == 0, "chain %d: --resume latest after a kill failed (exit %d):\n%s", chains, st, out);
        ok = st == 0 && same_as_reference(d, refdir);
        CHECK(ok, "chain %d: the resumed run differs from the uninterrupted one", chains);
    }
    printf("kill test: %d SIGKILLs in %d chains in %.1f s (uniform over a %.2f s run); after a kill: %d without a "
           "complete checkpoint, %d with temporary files, %d with a state file without weights (half the kills "
           "timed inside a save); %d runs ended before their kill; %s\n",
           done, chains, now() - t0, t_run, no_ckpt, with_tmp, with_orphan, finished_early,
           ok ? "every --resume latest succeeded and ended bit-identical to the uninterrupted run" : "FAILED (above)");
}

// Rewrites a safetensors file as vlmoe wrote it before checksums and pairing keys: those metadata
// keys removed, the header padded with spaces to its old length (the data stays where it was).
static void make_old(const char *path) {
    size_t n;
    char *buf = test_read_file(path, &n);
    CHECK(buf && n > 8, "read %s", path);
    if (!buf || n <= 8) {
        free(buf);
        return;
    }
    uint64_t hlen = 0;
    for (int i = 7; i >= 0; i--) hlen = hlen << 8 | (unsigned char)buf[i];
    char *h = malloc(hlen + 1);
    memcpy(h, buf + 8, hlen), h[hlen] = 0;
    cJSON *hdr = cJSON_Parse(h), *meta = cJSON_GetObjectItemCaseSensitive(hdr, "__metadata__");
    static const char *const keys[] = {"vlmoe.crc32", "vlmoe.run_id", "vlmoe.step", "vlmoe.save_id"};
    for (int i = 0; i < 4; i++) cJSON_DeleteItemFromObjectCaseSensitive(meta, keys[i]);
    char *t = cJSON_PrintUnformatted(hdr);
    CHECK(t && strlen(t) <= hlen, "old header of %s", path);
    if (t && strlen(t) <= hlen) {
        memset(buf + 8, ' ', hlen);
        memcpy(buf + 8, t, strlen(t));
        test_write_file(path, buf, n);
    }
    cJSON_free(t), cJSON_Delete(hdr), free(h), free(buf);
}

// ---- 3. damaged and mismatched pairs, crafted where a random kill rarely lands
static void crafted_pairs(const char *refdir) {
    char d[400], a[700], b[700];
    // (a) killed between the first checkpoint's two renames: only step_1's state file exists
    snprintf(d, sizeof(d), "%s/first", root);
    copy_dir(refdir, d);
    sh("cd %s/logs/r/checkpoints && rm -f step_*.safetensors.tmp.* step_[0-9].safetensors step_[2-9].state.safetensors"
       "%s", d, "");
    CHECK(exists(test_path(d, "logs/r/checkpoints/step_1.state.safetensors")) &&
          !exists(test_path(d, "logs/r/checkpoints/step_1.safetensors")), "set-up: an orphan state of step 1");
    test_expect_in(d, bin, RUN " --name r --resume latest", 0, "holds no complete checkpoint", out, sizeof(out));
    CHECK(same_as_reference(d, refdir), "restart after a kill in the first checkpoint differs");
    // (b) the newest weights with the state of another save of the same step (another run's)
    snprintf(d, sizeof(d), "%s/mixed", root);
    copy_dir(refdir, d);
    sh("mkdir -p %s/other%s", d, ""); // a second run of the same flags: other save ids
    CHECK(test_run_in(test_path(d, "other"), bin, RUN " --name r", 1, out, sizeof(out)) == 0, "second run: %s", out);
    snprintf(a, sizeof(a), "%s/other/logs/r/checkpoints/step_%d.state.safetensors", d, STEPS);
    snprintf(b, sizeof(b), "%s/logs/r/checkpoints/step_%d.state.safetensors", d, STEPS);
    CHECK(rename(a, b) == 0, "swap states");
    test_expect_in(d, bin, RUN " --name r --resume latest", 0, "are not one checkpoint", out, sizeof(out));
    CHECK(strstr(out, "trying the one before it") && same_as_reference(d, refdir), "mixed pair: %s", out);
    // (c) weights of step 4 with the state of step 3
    snprintf(d, sizeof(d), "%s/steps", root);
    copy_dir(refdir, d);
    snprintf(a, sizeof(a), "%s/logs/r/checkpoints/step_%d.state.safetensors", d, STEPS - 1);
    snprintf(b, sizeof(b), "%s/logs/r/checkpoints/step_%d.state.safetensors", d, STEPS);
    CHECK(sh("cp %s %s", a, b) == 0, "copy state");
    test_expect_in(d, bin, RUN " --name r --resume latest", 0, "step 3, save", out, sizeof(out));
    CHECK(strstr(out, "are not one checkpoint") && same_as_reference(d, refdir), "steps 4 and 3: %s", out);
    // (e) a checkpoint of a vlmoe without checksums: resumed, with a note that it is unverified
    snprintf(d, sizeof(d), "%s/old", root);
    copy_dir(refdir, d);
    sh("rm %s/logs/r/checkpoints/step_4.safetensors %s/logs/r/checkpoints/step_4.state.safetensors", d, d);
    snprintf(a, sizeof(a), "%s/logs/r/checkpoints/step_3.safetensors", d);
    snprintf(b, sizeof(b), "%s/logs/r/checkpoints/step_3.state.safetensors", d);
    make_old(a), make_old(b);
    test_expect_in(d, bin, RUN " --name r --resume latest", 0, "carry no checksums", out, sizeof(out));
    CHECK(same_as_reference(d, refdir), "resumed from a checkpoint without checksums: differs");
    // (d) a flipped byte in the newest weights: refused on resume, the one before it resumed
    snprintf(d, sizeof(d), "%s/flip", root);
    copy_dir(refdir, d);
    snprintf(a, sizeof(a), "%s/logs/r/checkpoints/step_%d.safetensors", d, STEPS);
    FILE *f = fopen(a, "r+b");
    CHECK(f && !fseek(f, -1000, SEEK_END) && fputc(0x5a, f) != EOF && !fclose(f), "flip a byte of %s", a);
    test_expect_in(d, bin, RUN " --name r --resume latest", 0, "checksum mismatch", out, sizeof(out));
    CHECK(same_as_reference(d, refdir), "after a damaged newest checkpoint: differs");
}

// ---- 4. one flipped byte anywhere in a checkpoint's tensor data is detected on load
static void bit_flips(const char *refdir, int per_file) {
    const char *names[2] = {"step_4.safetensors", "step_4.state.safetensors"};
    int detected = 0, tried = 0;
    for (int k = 0; k < 2; k++) {
        char src[700], dst[700];
        snprintf(src, sizeof(src), "%s/logs/r/checkpoints/%s", refdir, names[k]);
        snprintf(dst, sizeof(dst), "%s/flipped.safetensors", root);
        size_t n;
        unsigned char *buf = (unsigned char *)test_read_file(src, &n);
        CHECK(buf && n > 8, "read %s", src);
        if (!buf || n <= 8) return;
        uint64_t hlen = 0;
        for (int i = 7; i >= 0; i--) hlen = hlen << 8 | buf[i];
        const size_t begin = 8 + (size_t)hlen; // the data area: every byte belongs to a tensor
        vlmoe_st *ok;
        CHECK(vlmoe_st_open(src, &ok) == VLMOE_OK, "%s does not load: %s", src, vlmoe_last_error());
        vlmoe_st_close(ok);
        for (int i = 0; i < per_file; i++) {
            // the first and last bytes, then positions spread over the data area
            const size_t at = i == 0 ? begin : i == 1 ? n - 1 : begin + (size_t)rand() % (n - begin);
            const unsigned char flip = (unsigned char)(1 + rand() % 255);
            buf[at] ^= flip;
            test_write_file(dst, buf, n);
            buf[at] ^= flip;
            vlmoe_st *f = NULL;
            const int st = vlmoe_st_open(dst, &f);
            const int caught = st == VLMOE_ERR_FORMAT && strstr(vlmoe_last_error(), "checksum mismatch");
            CHECK(caught, "%s: byte %zu ^ 0x%02x not detected (status %d: %s)", names[k], at, flip, st,
                  st ? vlmoe_last_error() : "loaded");
            vlmoe_st_close(f);
            detected += caught, tried++;
        }
        free(buf);
    }
    // a damaged list of checksums in the header: too short, or not hex
    static const struct { int keep; const char *tail, *needle; } lists[] = {
        {8, "", "lists 1 checksum, the file has"}, {0, "zzzzzzzz", "lists 0 checksums, the file has"}};
    for (int i = 0; i < 2; i++) {
        char src[700], dst[700];
        snprintf(src, sizeof(src), "%s/logs/r/checkpoints/step_4.safetensors", refdir);
        snprintf(dst, sizeof(dst), "%s/crclist.safetensors", root);
        size_t n;
        char *buf = test_read_file(src, &n), *at = buf ? strstr(buf + 8, "\"vlmoe.crc32\":\"") : NULL;
        CHECK(at != NULL, "%s has no checksums", src);
        if (!at) {
            free(buf);
            break;
        }
        char *v = at + strlen("\"vlmoe.crc32\":\""), *end = strchr(v, '"');
        memcpy(v + lists[i].keep, lists[i].tail, strlen(lists[i].tail));
        memset(v + lists[i].keep + strlen(lists[i].tail), ' ', (size_t)(end - v) - lists[i].keep - strlen(lists[i].tail));
        test_write_file(dst, buf, n);
        free(buf);
        vlmoe_st *f = NULL;
        const int st = vlmoe_st_open(dst, &f);
        CHECK(st == VLMOE_ERR_FORMAT && strstr(vlmoe_last_error(), lists[i].needle), "damaged checksum list %d: %s", i,
              st ? vlmoe_last_error() : "loaded");
        vlmoe_st_close(f);
    }
    printf("bit flips: %d of %d single-byte changes across the weights' and the state's tensor data detected on load\n",
           detected, tried);
}

// ---- 5. a full disk: RLIMIT_FSIZE with SIGXFSZ ignored, so writes fail with EFBIG
static int run_limited(const char *dir, const char *args, long bytes, char *buf, size_t cap) {
    char cmd[4096], path[700];
    snprintf(path, sizeof(path), "%s/limited.out", root);
    snprintf(cmd, sizeof(cmd), "cd %s && exec %s %s >%s 2>&1", dir, bin, args, path);
    const pid_t pid = fork();
    if (pid == 0) {
        const struct rlimit rl = {(rlim_t)bytes, (rlim_t)bytes};
        signal(SIGXFSZ, SIG_IGN);
        setrlimit(RLIMIT_FSIZE, &rl);
        execl("/bin/sh", "sh", "-c", cmd, (char *)NULL);
        _exit(127);
    }
    int status = 0;
    waitpid(pid, &status, 0);
    char *o = test_read_file(path, NULL);
    snprintf(buf, cap, "%s", o ? o : "");
    free(o);
    return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

// Every line of metrics.jsonl whole and parsed, steps 1..n once each; returns n (-1 if not so).
static int whole_records(const char *path) {
    size_t len;
    char *m = test_read_file(path, &len);
    if (!m || (len && m[len - 1] != '\n')) return free(m), -1;
    int n = 0;
    for (char *line = strtok(m, "\n"); line; line = strtok(NULL, "\n")) {
        cJSON *o = cJSON_Parse(line);
        const cJSON *s = cJSON_GetObjectItemCaseSensitive(o, "step");
        const int good = cJSON_IsNumber(s) && (int)s->valuedouble == n + 1;
        cJSON_Delete(o);
        if (!good) return free(m), -1;
        n++;
    }
    free(m);
    return n;
}

static void full_disk(const char *refdir) {
    char d[400];
    // (a) metrics.jsonl reaches the limit: the run stops, every record before is whole and kept
    snprintf(d, sizeof(d), "%s/full_metrics", root);
    sh("rm -rf %s && mkdir -p %s", d, d);
    int st = run_limited(d, "train --model tiny --batch-size 4 --steps 100000 --log-every-n-steps 1 --eval-samples 0 "
                         "--threads 1 --logs logs --name r", 6000, out, sizeof(out));
    CHECK(st == 1 && strstr(out, "cannot write logs/r/metrics.jsonl: File too large"), "exit %d:\n%s", st,
          out + (strlen(out) > 2000 ? strlen(out) - 2000 : 0));
    const char *last = NULL;
    for (const char *p = out; (p = strstr(p, "step ")); p++) last = p; // the last progress line printed
    long shown = -1;
    if (last) sscanf(last, "step %ld/", &shown);
    const int n = whole_records(test_path(d, "logs/r/metrics.jsonl"));
    CHECK(n >= 5 && n == shown, "metrics.jsonl after the failure: %d whole records, the last step printed %ld", n, shown);
    printf("full disk, metrics: stopped with exit %d at step %ld, %d whole records kept\n", st, shown + 1, n);
    // (b) a checkpoint reaches the limit (the state file is larger than the weights): the run
    // stops, the checkpoints before it load and resume to the uninterrupted run's result
    snprintf(d, sizeof(d), "%s/full_ckpt", root);
    copy_dir(refdir, d);
    sh("cd %s/logs/r/checkpoints && rm step_4.safetensors step_4.state.safetensors%s", d, "");
    const uint64_t before = file_sum(test_path(d, "logs/r/checkpoints/step_3.safetensors"));
    st = run_limited(d, RUN " --name r --resume latest", 700000, out, sizeof(out));
    CHECK(st == 1 && strstr(out, "checkpoint") && strstr(out, "step_4.state.safetensors") && strstr(out, "File too large"),
          "exit %d:\n%s", st, out);
    int tmp, orphan, pairs, newest;
    census(d, &tmp, &orphan, &pairs, &newest);
    CHECK(tmp == 0 && orphan == 0 && pairs == 3, "after the failed save: %d temporary files, %d orphan states, %d pairs",
          tmp, orphan, pairs);
    CHECK(file_sum(test_path(d, "logs/r/checkpoints/step_3.safetensors")) == before, "step_3 changed");
    CHECK(whole_records(test_path(d, "logs/r/metrics.jsonl")) == STEPS, "metrics after the failed save");
    test_expect_in(d, bin, RUN " --name r --resume latest", 0, "resuming from", out, sizeof(out));
    CHECK(same_as_reference(d, refdir), "resumed after a full disk: differs");
    // (c) printed results (eval --json and the like) behind a redirection to a full disk
    char cmd[4700];
    snprintf(cmd, sizeof(cmd), "cd %s && %s version >/dev/full 2>stdout_err.txt", d, bin);
    if (exists("/dev/full")) {
        const int rc = system(cmd);
        char *err = test_read_file(test_path(d, "stdout_err.txt"), NULL);
        CHECK(WIFEXITED(rc) && WEXITSTATUS(rc) == 1 && err && strstr(err, "cannot write the standard output: No space"),
              "stdout on /dev/full: exit %d: %s", WIFEXITED(rc) ? WEXITSTATUS(rc) : -1, err ? err : "");
        free(err);
    }
}

int main(int argc, char **argv) {
    (void)argc;
    if (!(bin = test_vlmoe_bin(argv[0], bin_buf))) return test_summary("test_hostile_files");
    const int asan = strstr(argv[0], "/asan/") != NULL;
    const char *k = getenv("VLMOE_HOSTILE_KILLS"), *fl = getenv("VLMOE_HOSTILE_FLIPS");
    const int kills = k ? atoi(k) : asan ? 50 : 200, flips = fl ? atoi(fl) : asan ? 12 : 64;
    snprintf(root, sizeof(root), "/tmp/vlmoe_hostile_files_XXXXXX");
    CHECK(mkdtemp(root) != NULL, "mkdtemp");
    char ref[400];
    snprintf(ref, sizeof(ref), "%s/ref", root);
    mkdir(ref, 0755);
    const double t0 = now();
    const int st = test_run_in(ref, bin, RUN " --name r", 1, out, sizeof(out));
    const double t_run = now() - t0;
    CHECK(st == 0, "reference run: %s", out);
    if (st == 0) {
        outputs_vs_inputs(ref);
        bit_flips(ref, flips);
        crafted_pairs(ref);
        full_disk(ref);
        kill_test(ref, t_run, kills);
    }
    if (!t_fail) sh("rm -rf %s%s", root, "");
    else fprintf(stderr, "left %s for inspection\n", root);
    return test_summary("test_hostile_files");
}
