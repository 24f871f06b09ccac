// test_readers.c: tests for src/data/readers.c (MODEL.md "Data"): brace expansion, OpenCLIP
// CSV/TSV with RFC 4180 quoting and bad rows, webdataset shards (plain, gzip, cut mid-member),
// position/seek, pipe: shards (commands, failures), OpenCLIP's cwd-relative CSV image paths with the
// CSV-folder fallback, bad-sample policy and the image-folder reader. Fixtures are built in a mkdtemp dir.
#include <sys/stat.h>
#include <unistd.h>

#include "data/readers.h"
#include "test.h"
#include "test_tar.h"

static char dir[64];

static const char *P(const char *rel) { return test_path(dir, rel); }
static void put(const char *rel, const char *text) { test_write_file(P(rel), text, strlen(text)); }

static int expand_eq(const char *pat, const char **want, int nwant) {
    char **v; int n;
    int st = vlmoe_expand_braces(pat, &v, &n);
    if (st) { fprintf(stderr, "expand %s: %s\n", pat, vlmoe_last_error()); return 0; }
    int ok = n == nwant;
    for (int i = 0; ok && i < n; i++) ok = strcmp(v[i], want[i]) == 0;
    if (!ok) {
        fprintf(stderr, "expand %s gave %d:", pat, n);
        for (int i = 0; i < n && i < 10; i++) fprintf(stderr, " %s", v[i]);
        fprintf(stderr, "\n");
    }
    vlmoe_free_strings(v, n);
    return ok;
}

static void test_braces(void) {
    const char *w1[] = {"a-000.tar", "a-001.tar", "a-002.tar"};
    CHECK(expand_eq("a-{000..002}.tar", w1, 3), "zero-padded range");
    const char *w2[] = {"a1", "a2", "b1", "b2"};
    CHECK(expand_eq("{a,b}{1..2}", w2, 4), "two groups");
    const char *w3[] = {"x08", "x09", "x10"};
    CHECK(expand_eq("x{08..10}", w3, 3), "padding keeps width");
    const char *w4[] = {"x8", "x9", "x10"};
    CHECK(expand_eq("x{8..10}", w4, 3), "no padding");
    const char *w5[] = {"3", "2", "1"};
    CHECK(expand_eq("{3..1}", w5, 3), "descending");
    const char *w6[] = {"paq", "p1q", "p2q"};
    CHECK(expand_eq("p{a,{1..2}}q", w6, 3), "nested");
    const char *w7[] = {"a", "b1", "b2"};
    CHECK(expand_eq("a::b{1,2}", w7, 3), ":: lists");
    const char *w8[] = {"plain.tar"};
    CHECK(expand_eq("plain.tar", w8, 1), "no braces");
    const char *w9[] = {"s-000000.tar", "s-000001.tar"};
    CHECK(expand_eq("s-{000000..000001}.tar", w9, 2), "webdataset style");
    const char *bad[] = {"a{1..3", "a}b", "x{}", "{5}", "{1..x}", "a::", "::a", "{0..9999}{0..999}",
                         "{a,b"};
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
        char **v = NULL; int n = -1;
        int st = vlmoe_expand_braces(bad[i], &v, &n);
        CHECK(st == VLMOE_ERR_ARG && v == NULL && n == 0, "pattern %s should fail (st %d)", bad[i], st);
        CHECK(strstr(vlmoe_last_error(), bad[i]) != NULL, "message names the pattern: %s",
              vlmoe_last_error());
    }
    vlmoe_expand_braces("a{1..3", &(char **){NULL}, &(int){0});
    CHECK(strstr(vlmoe_last_error(), "unmatched '{'") != NULL, "%s", vlmoe_last_error());
    vlmoe_expand_braces("{5}", &(char **){NULL}, &(int){0});
    CHECK(strstr(vlmoe_last_error(), "neither a list") != NULL, "%s", vlmoe_last_error());
}

static vlmoe_dataset *open_ds(vlmoe_dataset_type t, const char *path, char sep) {
    vlmoe_dataset_params p = vlmoe_dataset_default_params();
    p.type = t; p.path = path; p.separator = sep;
    vlmoe_dataset *ds = NULL;
    int st = vlmoe_dataset_open(&p, &ds);
    CHECK(st == VLMOE_OK, "open %s: %s", path, vlmoe_last_error());
    return ds;
}

static void test_csv(void) {
    mkdir(P("img"), 0755);
    put("img/a.png", "\x89PNG fake a");
    put("img/b.png", "fake b bytes");
    put("img/c.jpg", "c");
    put("img/empty.png", "");
    char csv[2048];
    snprintf(csv, sizeof csv,
             "filepath,title,extra\n"
             "img/a.png,\"a cat, sitting\",x\n"        // 2
             "img/b.png,\"she said \"\"hi\"\"\",y\n"   // 3
             "img/c.jpg,\"two\nlines\",z\n"            // 4-5
             "img/a.png\n"                             // 6 missing column
             "img/b.png,   ,q\n"                       // 7 empty caption
             "img/missing.png,a dog,w\n"               // 8 unreadable image
             "\n"                                      // 9 blank: skipped
             "%s,absolute path ,v\n"                   // 10
             "img/c.jpg,crlf caption\r\n"              // 11
             "img/empty.png,empty file\n"              // 12 unreadable (0 bytes)
             ",no path\n",                             // 13 unreadable (empty path)
             P("img/b.png"));
    put("data.csv", csv);
    vlmoe_dataset *ds = open_ds(VLMOE_DATASET_AUTO, P("data.csv"), ',');
    if (!ds) return;
    const char *caps[] = {"a cat, sitting", "she said \"hi\"", "two\nlines", "absolute path", "crlf caption"};
    const int lines[] = {2, 3, 4, 10, 11};
    const char *imgs[] = {"\x89PNG fake a", "fake b bytes", "c", "fake b bytes", "c"};
    vlmoe_sample s;
    vlmoe_dataset_pos after2 = {-1, -1};
    int n = 0;
    while (vlmoe_dataset_next(ds, &s) == 1) {
        if (n < 5) {
            char key[600];
            snprintf(key, sizeof key, "%s:%d", P("data.csv"), lines[n]);
            CHECK(strcmp(s.caption, caps[n]) == 0, "caption %d: '%s'", n, s.caption);
            CHECK(strcmp(s.key, key) == 0, "key %d: %s (want %s)", n, s.key, key);
            CHECK(s.image_len == strlen(imgs[n]) && memcmp(s.image, imgs[n], s.image_len) == 0,
                  "image bytes %d", n);
        }
        if (n == 1) after2 = vlmoe_dataset_position(ds);
        n++;
    }
    CHECK(n == 5, "csv good samples %d", n);
    const vlmoe_dataset_stats *st = vlmoe_dataset_get_stats(ds);
    CHECK(st->total == 10, "total %lld", (long long)st->total);
    CHECK(st->bad[VLMOE_BAD_MISSING_COLUMN] == 1, "missing_column %lld", (long long)st->bad[0]);
    CHECK(st->bad[VLMOE_BAD_EMPTY_CAPTION] == 1, "empty_caption");
    CHECK(st->bad[VLMOE_BAD_UNREADABLE_IMAGE] == 3, "unreadable %lld", (long long)st->bad[2]);
    CHECK(st->n_msgs == 5 && strstr(st->msgs[0], "data.csv:6") != NULL, "first msg %s", st->msgs[0]);
    CHECK(strstr(st->msgs[2], "missing.png") != NULL, "msg names image: %s", st->msgs[2]);
    char sum[4096];
    vlmoe_dataset_stats_format(st, sum, sizeof sum);
    CHECK(strstr(sum, "bad samples: 5 of 10") && strstr(sum, "unreadable_image 3") &&
          strstr(sum, "missing_column 1"), "summary: %s", sum);
    CHECK(vlmoe_dataset_check_bad(st, 0.5) == VLMOE_OK, "50%% allowed");
    CHECK(vlmoe_dataset_check_bad(st, 0.1) == VLMOE_ERR_FORMAT, "10%% exceeded");
    CHECK(strstr(vlmoe_last_error(), "too many bad samples") && strstr(vlmoe_last_error(), "data.csv:6"),
          "%s", vlmoe_last_error());
    // Resume: the position after the second sample is row 2; the next sample is line 4.
    CHECK(after2.shard == 0 && after2.item == 2, "pos (%lld,%lld)", (long long)after2.shard,
          (long long)after2.item);
    vlmoe_dataset_reset_stats(ds);
    CHECK(vlmoe_dataset_seek(ds, after2) == VLMOE_OK, "seek: %s", vlmoe_last_error());
    CHECK(vlmoe_dataset_next(ds, &s) == 1 && strcmp(s.caption, "two\nlines") == 0, "after seek");
    CHECK(vlmoe_dataset_get_stats(ds)->total == 1, "seek does not count skipped rows");
    CHECK(vlmoe_dataset_rewind(ds) == VLMOE_OK, "rewind");
    CHECK(vlmoe_dataset_next(ds, &s) == 1 && strcmp(s.caption, "a cat, sitting") == 0, "after rewind");
    vlmoe_dataset_pos far = {0, 99};
    CHECK(vlmoe_dataset_seek(ds, far) == VLMOE_ERR_ARG, "seek past end");
    vlmoe_dataset_free(ds);

    // TSV with the default separator, columns in another order, custom keys not needed.
    put("data.tsv", "title\tfilepath\n\"quoted\ttab\"\timg/a.png\nplain\timg/c.jpg\n");
    ds = open_ds(VLMOE_DATASET_AUTO, P("data.tsv"), '\t');
    if (ds) {
        CHECK(vlmoe_dataset_next(ds, &s) == 1 && strcmp(s.caption, "quoted\ttab") == 0, "tsv 1");
        CHECK(vlmoe_dataset_next(ds, &s) == 1 && strcmp(s.caption, "plain") == 0 &&
              strcmp(s.image_ext, "jpg") == 0, "tsv 2");
        CHECK(vlmoe_dataset_next(ds, &s) == 0, "tsv end");
        CHECK(vlmoe_dataset_next(ds, &s) == 0, "tsv stays at end");
        vlmoe_dataset_free(ds);
    }

    // Custom keys and a separator of ';' plus a UTF-8 BOM.
    put("semi.csv", "\xEF\xBB\xBFimg;cap\nimg/a.png;semi\n");
    vlmoe_dataset_params p = vlmoe_dataset_default_params();
    p.path = P("semi.csv"); p.separator = ';'; p.img_key = "img"; p.caption_key = "cap";
    CHECK(vlmoe_dataset_open(&p, &ds) == VLMOE_OK, "semi: %s", vlmoe_last_error());
    if (ds) {
        CHECK(vlmoe_dataset_next(ds, &s) == 1 && strcmp(s.caption, "semi") == 0, "semi sample");
        vlmoe_dataset_free(ds);
    }

    // Unterminated quote at the end of the file.
    put("open.csv", "filepath,title\nimg/a.png,ok\nimg/a.png,\"never closed\n");
    ds = open_ds(VLMOE_DATASET_CSV, P("open.csv"), ',');
    if (ds) {
        CHECK(vlmoe_dataset_next(ds, &s) == 1, "open.csv first");
        CHECK(vlmoe_dataset_next(ds, &s) == 0, "open.csv end");
        CHECK(vlmoe_dataset_get_stats(ds)->bad[VLMOE_BAD_MALFORMED_ROW] == 1, "malformed row");
        vlmoe_dataset_free(ds);
    }

    // Hard errors: missing key column (names file, column, header columns), missing file.
    put("badhdr.csv", "path,caption\nimg/a.png,x\n");
    p = vlmoe_dataset_default_params();
    p.path = P("badhdr.csv"); p.separator = ',';
    ds = NULL;
    CHECK(vlmoe_dataset_open(&p, &ds) == VLMOE_ERR_CONFIG && ds == NULL, "missing column is an error");
    const char *e = vlmoe_last_error();
    CHECK(strstr(e, "badhdr.csv") && strstr(e, "'filepath'") && strstr(e, "'path', 'caption'"),
          "message: %s", e);
    p.img_key = "path";
    CHECK(vlmoe_dataset_open(&p, &ds) == VLMOE_ERR_CONFIG, "caption column missing");
    CHECK(strstr(vlmoe_last_error(), "'title'") && strstr(vlmoe_last_error(), "--csv-caption-key"),
          "%s", vlmoe_last_error());
    p.path = P("nope.csv");
    CHECK(vlmoe_dataset_open(&p, &ds) == VLMOE_ERR_IO && strstr(vlmoe_last_error(), "nope.csv"),
          "missing csv: %s", vlmoe_last_error());
    p.path = P("data.json");
    p.type = VLMOE_DATASET_AUTO;
    CHECK(vlmoe_dataset_open(&p, &ds) == VLMOE_ERR_ARG && strstr(vlmoe_last_error(), "--dataset-type"),
          "auto type: %s", vlmoe_last_error());
}

static void test_webdataset(void) {
    mkdir(P("shards"), 0755);
    const member s0[] = {
        M("000000.jpg", "JPEG0"), M("000000.txt", "  hello  \n"),
        M("000001.png", "PNG1"), M("000001.txt", "world"),
        M("000002.jpg", "lonely image"),
        M("000003.txt", "caption only"),
        M("000004.webp", "WEBP4"), M("000004.txt", " \n"),
        M("000005.jpg", "JPEG5"), M("000005.json", "{}"), M("000005.txt", "last"),
    };
    write_tar(P("shards/train-000000.tar"), 0, s0, (int)(sizeof s0 / sizeof *s0));
    static char big1[3000], big2[5000];
    memset(big1, 'x', sizeof big1);
    memset(big2, 'y', sizeof big2);
    const member s1[] = {
        {"sub/000010.jpg", big1, sizeof big1}, M("sub/000010.txt", "ten"),
        {"sub/000011.jpg", big2, sizeof big2}, M("sub/000011.txt", "eleven"),
    };
    write_tar(P("shards/train-000001.tar"), 0, s1, 4);
    // ustar: 512-byte header + data padded to 512. Cut 1000 bytes into 000011.jpg's data.
    CHECK(truncate(P("shards/train-000001.tar"), 512 + 3072 + 512 + 512 + 512 + 1000) == 0, "truncate");
    const member s2[] = {
        M("x1.seg.jpg", "X1"), M("x1.txt", "multi dot"),
        M("x2.JPEG", "X2"), M("x2.txt", "upper ext"),
    };
    write_tar(P("shards/extra.tar.gz"), 1, s2, 4);
    size_t gzn = 0;
    char *gz = test_read_file(P("shards/extra.tar.gz"), &gzn);
    CHECK(gz && gzn > 2 && (unsigned char)gz[0] == 0x1f && (unsigned char)gz[1] == 0x8b, "gzip magic");
    free(gz);

    char pat[600];
    snprintf(pat, sizeof pat, "%s::%s", P("shards/train-{000000..000001}.tar"), P("shards/extra.tar.gz"));
    vlmoe_dataset *ds = open_ds(VLMOE_DATASET_AUTO, pat, '\t');
    if (!ds) return;
    CHECK(vlmoe_dataset_n_shards(ds) == 3, "3 shards");
    const char *keys[] = {"train-000000.tar:000000", "train-000000.tar:000001",
                          "train-000000.tar:000005", "train-000001.tar:sub/000010",
                          "extra.tar.gz:x1", "extra.tar.gz:x2"};
    const char *caps[] = {"hello", "world", "last", "ten", "multi dot", "upper ext"};
    const char *exts[] = {"jpg", "png", "jpg", "jpg", "jpg", "jpeg"};
    vlmoe_sample s;
    vlmoe_dataset_pos pos[8];
    int n = 0;
    while (vlmoe_dataset_next(ds, &s) == 1) {
        if (n < 6) {
            CHECK(strstr(s.key, keys[n]) != NULL, "key %d: %s", n, s.key);
            CHECK(strcmp(s.caption, caps[n]) == 0, "caption %d: '%s'", n, s.caption);
            CHECK(strcmp(s.image_ext, exts[n]) == 0, "ext %d: %s", n, s.image_ext);
            pos[n] = vlmoe_dataset_position(ds);
        }
        n++;
    }
    CHECK(n == 6, "webdataset samples %d", n);
    const vlmoe_dataset_stats *st = vlmoe_dataset_get_stats(ds);
    CHECK(st->bad[VLMOE_BAD_NO_PARTNER] == 2, "no_partner %lld", (long long)st->bad[3]);
    CHECK(st->bad[VLMOE_BAD_EMPTY_CAPTION] == 1, "empty caption %lld", (long long)st->bad[1]);
    CHECK(st->bad[VLMOE_BAD_TRUNCATED_SHARD] == 1, "truncated %lld", (long long)st->bad[4]);
    CHECK(st->total == 10, "total %lld", (long long)st->total);
    CHECK(strstr(st->msgs[0], "000002") && strstr(st->msgs[0], "image without"), "msg0 %s", st->msgs[0]);
    CHECK(strstr(st->msgs[1], "000003") && strstr(st->msgs[1], "caption without"), "msg1 %s", st->msgs[1]);
    CHECK(strstr(st->msgs[3], "train-000001.tar") && strstr(st->msgs[3], "000011"), "truncated msg %s",
          st->msgs[3]);
    // Positions: after sample 0 the next sample starts at member 2 of shard 0; after the last
    // sample of shard 0 the next member is past the end; after the shard is done (3, 0).
    CHECK(pos[0].shard == 0 && pos[0].item == 2, "pos0 (%lld,%lld)", (long long)pos[0].shard,
          (long long)pos[0].item);
    CHECK(pos[5].shard == 3 && pos[5].item == 0, "pos5 (%lld,%lld)", (long long)pos[5].shard,
          (long long)pos[5].item);
    CHECK(vlmoe_dataset_next(ds, &s) == 0, "end stays end");
    CHECK(vlmoe_dataset_seek(ds, pos[0]) == VLMOE_OK, "seek: %s", vlmoe_last_error());
    CHECK(vlmoe_dataset_next(ds, &s) == 1 && strstr(s.key, "000001") && !strcmp(s.caption, "world"),
          "after seek %s", s.key);
    CHECK(vlmoe_dataset_seek(ds, pos[3]) == VLMOE_OK, "seek 3");
    vlmoe_dataset_pos here = vlmoe_dataset_position(ds);
    CHECK(here.shard == pos[3].shard && here.item == pos[3].item, "position after seek");
    vlmoe_dataset_pos s2pos = {2, 0};
    CHECK(vlmoe_dataset_seek(ds, s2pos) == VLMOE_OK, "seek shard 2");
    CHECK(vlmoe_dataset_next(ds, &s) == 1 && strstr(s.key, "extra.tar.gz:x1"), "shard 2 first");
    vlmoe_dataset_pos far = {0, 500};
    CHECK(vlmoe_dataset_seek(ds, far) == VLMOE_ERR_ARG, "seek past shard end");
    CHECK(vlmoe_dataset_rewind(ds) == VLMOE_OK, "rewind");
    CHECK(vlmoe_dataset_next(ds, &s) == 1 && strcmp(s.caption, "hello") == 0, "after rewind");
    vlmoe_dataset_free(ds);

    // Missing shards: a hard error at open naming the first missing one and how many.
    vlmoe_dataset_params p = vlmoe_dataset_default_params();
    p.path = P("shards/train-{000000..000005}.tar");
    ds = NULL;
    CHECK(vlmoe_dataset_open(&p, &ds) == VLMOE_ERR_IO && ds == NULL, "missing shards");
    CHECK(strstr(vlmoe_last_error(), "train-000002.tar") && strstr(vlmoe_last_error(), "4 of 6"),
          "%s", vlmoe_last_error());
    p.path = P("shards/train-{000000..000001.tar");
    CHECK(vlmoe_dataset_open(&p, &ds) == VLMOE_ERR_ARG, "malformed pattern");
    // A shard that is not a tar at all counts as a bad shard, the next one is still read.
    put("shards/junk.tar", "this is not a tar archive, not even close; just text");
    snprintf(pat, sizeof pat, "%s::%s", P("shards/junk.tar"), P("shards/extra.tar.gz"));
    p.path = pat;
    CHECK(vlmoe_dataset_open(&p, &ds) == VLMOE_OK, "junk: %s", vlmoe_last_error());
    if (ds) {
        n = 0;
        while (vlmoe_dataset_next(ds, &s) == 1) n++;
        CHECK(n == 2, "after junk shard %d", n);
        CHECK(vlmoe_dataset_get_stats(ds)->bad[VLMOE_BAD_TRUNCATED_SHARD] == 1, "junk counted");
        vlmoe_dataset_free(ds);
    }
}

// Damaged shards end the shard (counted) instead of looping on the failed header, and samples
// keep their promises: image_len > 0, a caption that is non-empty as a C string.
static void test_webdataset_damage(void) {
    const member m[] = {M("000000.jpg", "JPEG0"), M("000000.txt", "first"), M("000001.png", "PNG1"),
                        M("000001.txt", "second"), M("a.jpg", ""), M("a.txt", "empty image"),
                        M("b.jpg", "B"), M("b.txt", "\0starts with NUL"), M("c.jpg", "C"), M("c.txt", "fine")};
    write_tar(P("shards/damage.tar"), 0, m, 10);
    size_t n = 0;
    char *tar = test_read_file(P("shards/damage.tar"), &n);
    CHECK(tar && n > 4096 + 512, "damage.tar");
    if (!tar) return;
    // 512-byte header + 512 bytes of data per member: member 4 (a.jpg) starts at 4096. The
    // sample before it is complete; the one that the damaged header ends is dropped.
    test_write_file(P("shards/cut_header.tar"), tar, 4096 + 100);   // inside member 4's header
    tar[4096] ^= 0x20;                                              // its name: checksum now wrong
    test_write_file(P("shards/bad_checksum.tar"), tar, n);
    free(tar);
    const char *names[] = {"shards/cut_header.tar", "shards/bad_checksum.tar", "shards/damage.tar"};
    for (int k = 0; k < 3; k++) {
        vlmoe_dataset *ds = open_ds(VLMOE_DATASET_WEBDATASET, P(names[k]), '\t');
        if (!ds) continue;
        vlmoe_sample s;
        int got = 0, r;
        while ((r = vlmoe_dataset_next(ds, &s)) == 1 && got < 10) {
            CHECK(s.image_len > 0 && s.caption[0], "%s: sample %s: image %zu bytes, caption '%s'", names[k], s.key,
                  s.image_len, s.caption);
            got++;
        }
        const vlmoe_dataset_stats *st = vlmoe_dataset_get_stats(ds);
        if (k < 2) {
            CHECK(r == 0 && got == 1 && st->bad[VLMOE_BAD_TRUNCATED_SHARD] == 1, "%s: r %d, %d samples, %lld bad shards",
                  names[k], r, got, (long long)st->bad[VLMOE_BAD_TRUNCATED_SHARD]);
        } else {
            CHECK(r == 0 && got == 3 && st->bad[VLMOE_BAD_UNREADABLE_IMAGE] == 1 && st->bad[VLMOE_BAD_EMPTY_CAPTION] == 1,
                  "damage.tar: r %d, %d samples, unreadable %lld, empty caption %lld", r, got,
                  (long long)st->bad[VLMOE_BAD_UNREADABLE_IMAGE], (long long)st->bad[VLMOE_BAD_EMPTY_CAPTION]);
        }
        vlmoe_dataset_free(ds);
    }
    CHECK(vlmoe_dataset_next(NULL, NULL) < 0, "a failure is < 0, never the 1 of a sample");
}

// Every sample of a dataset as "KEY-SUFFIX|caption|image bytes" lines (KEY-SUFFIX: after the last
// '/' of the key, which drops a pipe: command's prefix), the stats in *st.
static int read_all(const char *path, char *out, size_t cap, vlmoe_dataset_stats *st) {
    vlmoe_dataset *ds = open_ds(VLMOE_DATASET_AUTO, path, '\t');
    int n = 0;
    size_t len = 0;
    out[0] = 0;
    vlmoe_sample s;
    while (ds && vlmoe_dataset_next(ds, &s) == 1 && len < cap) {
        len += (size_t)snprintf(out + len, cap - len, "%s|%s|%.*s\n", strrchr(s.key, '/') + 1, s.caption,
                                (int)s.image_len, (const char *)s.image);
        n++;
    }
    if (ds) *st = *vlmoe_dataset_get_stats(ds);
    vlmoe_dataset_free(ds);
    return n;
}

// pipe: shards (webdataset's "pipe:COMMAND" URLs): the same samples as the files, braces expanded
// inside the command, seek by re-reading, and a command that fails counted and named.
static void test_pipe(void) {
    static char a[8192], b[8192], pat[1024];
    vlmoe_dataset_stats sa, sb;
    // plain tar, gzip through the pipe's filter detection, and a brace list inside the command
    snprintf(pat, sizeof pat, "%s::%s", P("shards/train-000000.tar"), P("shards/extra.tar.gz"));
    const int na = read_all(pat, a, sizeof a, &sa);
    snprintf(pat, sizeof pat, "pipe:cat %s::pipe:cat %s", P("shards/train-000000.tar"), P("shards/extra.tar.gz"));
    const int nb = read_all(pat, b, sizeof b, &sb);
    CHECK(na == 5 && nb == na && !strcmp(a, b) && sb.total == sa.total && vlmoe_dataset_stats_bad(&sb) == 3,
          "pipe: %d samples (%lld bad), files %d:\n%s---\n%s", nb, (long long)vlmoe_dataset_stats_bad(&sb), na, b, a);
    snprintf(pat, sizeof pat, "pipe:cat %s | cat", P("shards/extra.tar.gz"));   // a webdataset by its "pipe:"
    CHECK(read_all(pat, b, sizeof b, &sb) == 2, "%s: %s", pat, b);
    snprintf(pat, sizeof pat, "pipe:cat %s/shards/{train-000000.tar,extra.tar.gz}", dir);
    CHECK(read_all(pat, b, sizeof b, &sb) == na && !strcmp(a, b), "braces in the command:\n%s", b);
    // seek inside a pipe: shard re-runs the command and skips to the member
    snprintf(pat, sizeof pat, "pipe:cat %s", P("shards/train-000000.tar"));
    vlmoe_dataset *ds = open_ds(VLMOE_DATASET_AUTO, pat, '\t');
    vlmoe_sample s;
    vlmoe_dataset_pos at = {0, 0};
    for (int i = 0; ds && i < 2 && vlmoe_dataset_next(ds, &s) == 1; i++) at = vlmoe_dataset_position(ds);
    CHECK(ds && at.item == 4 && vlmoe_dataset_next(ds, &s) == 1 && !strcmp(s.caption, "last"), "third sample");
    CHECK(ds && vlmoe_dataset_seek(ds, at) == VLMOE_OK && vlmoe_dataset_next(ds, &s) == 1 &&
          !strcmp(s.caption, "last") && vlmoe_dataset_next(ds, &s) == 0, "seek in a pipe: %s", vlmoe_last_error());
    vlmoe_dataset_free(ds);
    // failing commands: counted (with the samples given before kept), named with their status
    const char *fails[][2] = {{"pipe:exit 3", "exited with status 3"},
                              {"pipe:no_such_command_vlmoe", "exited with status 127"},
                              {"pipe:kill -9 $$", "killed by signal 9"}};
    for (int i = 0; i < 3; i++) {
        CHECK(read_all(fails[i][0], b, sizeof b, &sb) == 0 && sb.bad[VLMOE_BAD_FAILED_COMMAND] == 1 &&
              sb.n_msgs == 1 && strstr(sb.msgs[0], fails[i][0]) && strstr(sb.msgs[0], fails[i][1]),
              "%s: %lld failed commands: %s", fails[i][0], (long long)sb.bad[VLMOE_BAD_FAILED_COMMAND], sb.msgs[0]);
    }
    snprintf(pat, sizeof pat, "pipe:cat %s; exit 4", P("shards/train-000000.tar"));
    CHECK(read_all(pat, b, sizeof b, &sb) == 3 && sb.bad[VLMOE_BAD_FAILED_COMMAND] == 1 &&
          strstr(sb.msgs[3], "exit 4: the command exited with status 4"), "a tar, then status 4: %s", sb.msgs[3]);
    char sum[2048];
    vlmoe_dataset_stats_format(&sb, sum, sizeof sum);
    CHECK(strstr(sum, "failed_command 1"), "%s", sum);
}

// CSV image paths as OpenCLIP reads them: relative to the working directory; a path found only
// relative to the CSV's folder is read from there, with one note; one found nowhere names both.
static int notes;
static char note_msg[1024];
static void on_note(void *user, const char *msg) {
    notes++;
    snprintf(note_msg, sizeof note_msg, "%s", msg);
    (void)user;
}

static void test_csv_paths(void) {
    char old[4096];
    CHECK(getcwd(old, sizeof old) != NULL, "getcwd");
    mkdir(P("cw"), 0755), mkdir(P("cw/imgs"), 0755), mkdir(P("cw/data"), 0755), mkdir(P("cw/data/imgs"), 0755);
    mkdir(P("cw/data/only"), 0755);
    put("cw/imgs/a.png", "cwd a");            // the working directory's wins over
    put("cw/data/imgs/a.png", "csv-dir a");   // the CSV folder's file of the same name
    put("cw/data/only/b.png", "csv-dir b");
    put("cw/data/only/c.png", "csv-dir c");
    put("cw/data/pairs.csv", "filepath,title\nimgs/a.png,cwd\nonly/b.png,csv dir\nnowhere/x.png,gone\n"
                             "only/c.png,csv dir again\n");
    CHECK(chdir(P("cw")) == 0, "chdir");
    vlmoe_dataset_params p = vlmoe_dataset_default_params();
    p.path = "data/pairs.csv", p.separator = ',', p.note = on_note;
    vlmoe_dataset *ds = NULL;
    CHECK(vlmoe_dataset_open(&p, &ds) == VLMOE_OK, "%s", vlmoe_last_error());
    const char *want[][3] = {{"cwd", "imgs/a.png", "cwd a"}, {"csv dir", "data/only/b.png", "csv-dir b"},
                             {"csv dir again", "data/only/c.png", "csv-dir c"}};
    vlmoe_sample s;
    for (int i = 0; ds && i < 3; i++) {
        int r = vlmoe_dataset_next(ds, &s);
        CHECK(r == 1 && !strcmp(s.caption, want[i][0]) && !strcmp(s.image_path, want[i][1]) &&
              s.image_len == strlen(want[i][2]) && !memcmp(s.image, want[i][2], s.image_len),
              "row %d: %s from %s", i, r == 1 ? s.caption : "-", r == 1 ? s.image_path : "-");
        CHECK(notes == (i > 0), "after row %d: %d notes", i, notes);
    }
    CHECK(strstr(note_msg, "data/pairs.csv") && strstr(note_msg, "only/b.png") && strstr(note_msg, "CSV file's folder data/"),
          "note: %s", note_msg);
    const vlmoe_dataset_stats *st = ds ? vlmoe_dataset_get_stats(ds) : NULL;
    CHECK(st && st->bad[VLMOE_BAD_UNREADABLE_IMAGE] == 1 && strstr(st->msgs[0], "data/pairs.csv:4: image nowhere/x.png: ") &&
          strstr(st->msgs[0], "nor in the CSV's folder: data/"), "%s", st ? st->msgs[0] : "");
    vlmoe_dataset_free(ds);
    // deferred: the path as written; vlmoe_csv_image_path resolves it the same way
    p.defer_images = 1;
    CHECK(vlmoe_dataset_open(&p, &ds) == VLMOE_OK, "%s", vlmoe_last_error());
    char file[256];
    for (int i = 0; ds && i < 4 && vlmoe_dataset_next(ds, &s) == 1; i++) {
        const int alt = vlmoe_csv_image_path("data", s.image_path, file, sizeof file);
        const char *written[] = {"imgs/a.png", "only/b.png", "nowhere/x.png", "only/c.png"};
        const char *resolved[] = {"imgs/a.png", "data/only/b.png", "nowhere/x.png", "data/only/c.png"};
        CHECK(s.image == NULL && !strcmp(s.image_path, written[i]) && alt == (i == 1 || i == 3) &&
              !strcmp(file, resolved[i]), "deferred row %d: %s -> %s (%d)", i, s.image_path, file, alt);
    }
    vlmoe_dataset_free(ds);
    CHECK(vlmoe_csv_image_path("data", "only/b.png", file, 8) < 0 && strstr(vlmoe_last_error(), "longer than"), "small buffer");
    char *d = NULL;
    CHECK(!vlmoe_csv_dir("x.csv", &d) && !d && !vlmoe_csv_dir("./x.csv", &d) && !d && !vlmoe_csv_dir("a/b/x.csv", &d) &&
          d && !strcmp(d, "a/b"), "csv dir %s", d ? d : "(none)");
    free(d);
    CHECK(chdir(old) == 0, "chdir back");
}

static void test_image_folder(void) {
    mkdir(P("zs"), 0755);
    mkdir(P("zs/zebra_fish"), 0755);
    mkdir(P("zs/cat"), 0755);
    mkdir(P("zs/.hidden"), 0755);
    put("zs/zebra_fish/2.PNG", "p");
    put("zs/zebra_fish/1.jpg", "j");
    put("zs/zebra_fish/notes.txt", "n");
    put("zs/cat/b.jpeg", "b");
    put("zs/cat/a.webp", "a");
    put("zs/.hidden/x.jpg", "x");
    put("zs/readme.txt", "r");
    vlmoe_image_folder f;
    CHECK(vlmoe_image_folder_load(P("zs"), &f) == VLMOE_OK, "folder: %s", vlmoe_last_error());
    CHECK(f.n_classes == 2 && !strcmp(f.class_names[0], "cat") && !strcmp(f.class_names[1], "zebra fish"),
          "classes %d", f.n_classes);
    const char *want[] = {"zs/cat/a.webp", "zs/cat/b.jpeg", "zs/zebra_fish/1.jpg", "zs/zebra_fish/2.PNG"};
    const int lab[] = {0, 0, 1, 1};
    CHECK(f.n == 4, "images %lld", (long long)f.n);
    for (int i = 0; i < 4 && i < f.n; i++) {
        CHECK(strcmp(f.paths[i], P(want[i])) == 0, "path %d: %s", i, f.paths[i]);
        CHECK(f.labels[i] == lab[i], "label %d", i);
    }
    vlmoe_image_folder_free(&f);
    vlmoe_image_folder_free(NULL);
    CHECK(vlmoe_image_folder_load(P("nowhere"), &f) == VLMOE_ERR_IO && strstr(vlmoe_last_error(), "nowhere"),
          "missing root: %s", vlmoe_last_error());
    mkdir(P("empty_root"), 0755);
    put("empty_root/file.jpg", "j");
    CHECK(vlmoe_image_folder_load(P("empty_root"), &f) == VLMOE_ERR_FORMAT &&
          strstr(vlmoe_last_error(), "no class folders"), "no classes: %s", vlmoe_last_error());
    mkdir(P("zs/zz_empty"), 0755);
    CHECK(vlmoe_image_folder_load(P("zs"), &f) == VLMOE_ERR_FORMAT && strstr(vlmoe_last_error(), "zz_empty"),
          "empty class: %s", vlmoe_last_error());
    CHECK(f.n == 0 && f.paths == NULL, "zeroed on failure");
}

int main(void) {
    snprintf(dir, sizeof dir, "/tmp/vlmoe_readers_XXXXXX");
    if (!mkdtemp(dir)) { perror("mkdtemp"); return 1; }
    test_braces();
    test_csv();
    test_webdataset();
    test_webdataset_damage();
    test_pipe();
    test_csv_paths();
    test_image_folder();
    vlmoe_dataset_stats empty = {0};
    CHECK(vlmoe_dataset_check_bad(&empty, 0.0) == VLMOE_OK, "no samples: nothing to check");
    CHECK(strcmp(vlmoe_bad_reason_name(VLMOE_BAD_TRUNCATED_SHARD), "truncated_shard") == 0, "name");
    vlmoe_dataset_free(NULL);
    char cmd[128];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    if (system(cmd) != 0) fprintf(stderr, "could not remove %s\n", dir);
    return test_summary("test_readers");
}
