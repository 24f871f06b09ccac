// test_own_data.c: a user's own data, start to finish, as a new user runs it. A caption dataset in a
// vocabulary of its own (the synthetic shapes' images, every caption word replaced by one of 8
// made-up synonyms: 300+ distinct words, none of the synthetic data's) trains limoe-tiny with no
// tokenizer flag; then eval, classify, embed, prune and a resumed run get no tokenizer or
// normalisation flag at all and must take both from the checkpoint. Each trap of a model file
// that did not describe itself is checked: the synthetic word tokenizer used for captions, eval /
// prune / soup --greedy on the synthetic data for a model that never saw it, --pretrained
// training a new vocabulary, a tokenizer larger than a fixed vocabulary, flags contradicting
// the model file, and model files whose recorded inputs are corrupt.
// Runs $VLMOE_BIN (or $VLMOE_BIN_ASAN for the sanitizer build, which trains fewer steps and skips
// the accuracy threshold: it checks the same paths for memory errors).
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "io/safetensors.h"
#include "test.h"

static const char *bin;
static char dir[64], out[1 << 16];

static int expect(const char *args, int status, const char *needle) {
    return test_expect_in(dir, bin, args, status, needle, out, sizeof(out));
}

// A made-up word: three consonant-vowel syllables drawn from (word, synonym).
static void made_up(int word, int syn, char *w) {
    static const char cons[] = "bdfgklmnprstvz", vow[] = "aeiou";
    uint64_t h = (uint64_t)word * 0x9E3779B97F4A7C15ULL + (uint64_t)syn * 0xBF58476D1CE4E5B9ULL + 1;
    for (int i = 0; i < 3; i++) {
        h ^= h >> 31, h *= 0x94D049BB133111EBULL, h ^= h >> 29;
        w[2 * i] = cons[h % 14], w[2 * i + 1] = vow[(h >> 8) % 5];
    }
    w[6] = 0;
}

// The index of an English word in a growing list (the synthetic captions have about 40).
static int word_id(char words[][32], int *n, const char *w) {
    for (int i = 0; i < *n; i++)
        if (!strcmp(words[i], w)) return i;
    snprintf(words[*n], 32, "%s", w);
    return (*n)++;
}

// DIR/captions.csv -> DIR/own.csv with every caption word replaced by one of its 8 synonyms.
static int remap(const char *sub, char words[][32], int *nw) {
    char src[256], dst[256], line[4096];
    snprintf(src, sizeof(src), "%s/%s/captions.csv", dir, sub);
    snprintf(dst, sizeof(dst), "%s/%s/own.csv", dir, sub);
    FILE *f = fopen(src, "r"), *g = fopen(dst, "w");
    int row = 0;
    while (f && g && fgets(line, sizeof(line), f)) {
        char *tab = strchr(line, '\t');
        if (!tab || row++ == 0) {
            fputs(line, g);
            continue;
        }
        *tab = 0;
        fprintf(g, "%s\t", line);
        int k = 0;
        for (char *w = strtok(tab + 1, " \n"); w; w = strtok(NULL, " \n"), k++) {
            char mw[8];
            made_up(word_id(words, nw, w), (row * 7 + k) % 8, mw);
            fprintf(g, "%s%s", k ? " " : "", mw);
        }
        fputc('\n', g);
    }
    if (f) fclose(f);
    if (g) fclose(g);
    return row;
}

// Class names in the made-up vocabulary (synonym 0), one per line in sorted folder order.
static void classnames(char words[][32], int *nw) {
    static const char *colour[5] = {"blue", "green", "purple", "red", "yellow"};
    static const char *shape[4] = {"circle", "cross", "square", "triangle"};
    FILE *f = fopen(test_path(dir, "classnames.txt"), "w");
    for (int c = 0; f && c < 20; c++) {
        char a[8], b[8];
        made_up(word_id(words, nw, colour[c / 4]), 0, a);
        made_up(word_id(words, nw, shape[c % 4]), 0, b);
        fprintf(f, "%s %s\n", a, b);
    }
    if (f) fclose(f);
}

// The value of metadata key in a model file (malloc'd; NULL if absent or unreadable).
static char *metadata(const char *rel, const char *key) {
    vlmoe_st *f;
    if (vlmoe_st_open(test_path(dir, rel), &f)) return NULL;
    const char *v = vlmoe_st_metadata(f, key);
    char *c = v ? strdup(v) : NULL;
    vlmoe_st_close(f);
    return c;
}

// Copies file a to b replacing the first `from` by `to` (same length, so the header stays valid).
static void patch(const char *a, const char *b, const char *from, const char *to) {
    size_t n;
    char *d = test_read_file(test_path(dir, a), &n);
    char *at = NULL;
    for (size_t i = 0; d && !at && i + strlen(from) <= n; i++)
        if (!memcmp(d + i, from, strlen(from))) at = d + i;
    CHECK(at != NULL && strlen(from) == strlen(to), "%s holds '%s'", a, from);
    if (at) memcpy(at, to, strlen(to));
    if (d) test_write_file(test_path(dir, b), d, n);
    free(d);
}

// top-1 percentage of the first "zero-shot ... top-1 X%" in out (-1 if none).
static double top1(void) {
    const char *p = strstr(out, "top-1 ");
    return p ? atof(p + 6) : -1;
}

int main(int argc, char **argv) {
    static char abs[4096];
    if (!(bin = test_vlmoe_bin(argv[0], abs))) return test_summary("test_own_data");
    const int asan = strstr(argv[0], "/asan/") != NULL;
    snprintf(dir, sizeof(dir), "/tmp/vlmoe_own_XXXXXX");
    CHECK(mkdtemp(dir) != NULL, "mkdtemp");
    expect("synth export --out tr --n 2000", 0, "");
    expect("synth export --out va --n 400 --split val", 0, "");
    static char words[256][32];
    int nw = 0;
    CHECK(remap("tr", words, &nw) == 2001 && remap("va", words, &nw) == 401, "captions rewritten");
    classnames(words, &nw);

    // From scratch, no --tokenizer: a BPE vocabulary of the captions, and the token embedding sized to it
    char cmd[2048];
    const int steps = asan ? 30 : 150;
    snprintf(cmd, sizeof(cmd), "train --model limoe-tiny --train-data tr/own.csv --image-mean 0.5 --image-std 0.5 "
             "--steps %d --batch-size 64 --logs runs --name own --val-data va/own.csv --zeroshot-data va/classes "
             "--zeroshot-classnames classnames.txt", steps);
    expect(cmd, 0, "trained a BPE vocabulary of 1024 ids");
    CHECK(strstr(out, "zero-shot va/classes (20 classes") && strstr(out, "val va/own.csv (400 images"),
          "validation while training on the user's data:\n%s", out);
    CHECK(strstr(out, "sized to the tokenizer: 1024 ids") && !strstr(out, "synthetic data's word tokenizer"),
          "the named model's 256 ids became the tokenizer's 1024:\n%s", out);
    char ck[256];
    snprintf(ck, sizeof(ck), "runs/own/checkpoints/step_%d.safetensors", steps);

    // The checkpoint carries the tokenizer and the normalisation
    char *kind = metadata(ck, "vlmoe.tokenizer"), *text = metadata(ck, "vlmoe.tokenizer.text");
    char *pre = metadata(ck, "vlmoe.preprocess"), *trained = test_read_file(test_path(dir, "runs/own/tokenizer.txt"), NULL);
    CHECK(kind && !strcmp(kind, "bpe"), "vlmoe.tokenizer is %s", kind ? kind : "(none)");
    CHECK(text && trained && !strcmp(text, trained), "the checkpoint's tokenizer is the one the run trained");
    CHECK(pre && strstr(pre, "\"mean\": [0.5, 0.5, 0.5]") && strstr(pre, "\"std\": [0.5, 0.5, 0.5]") &&
          strstr(pre, "\"crop\": \"center\""), "vlmoe.preprocess: %s", pre ? pre : "(none)");
    free(kind), free(text), free(pre);

    // eval with no tokenizer or normalisation flag: held-out zero-shot on the made-up class names
    snprintf(cmd, sizeof(cmd), "eval --model %s --zeroshot-data va/classes --classnames classnames.txt --few-shot 0", ck);
    expect(cmd, 0, "zero-shot on va/classes (20 classes");
    const double acc = top1();
    printf("held-out zero-shot top-1 %.1f%% (chance 5%%, threshold 15%%)\n", acc);
    CHECK(asan || acc >= 15.0, "held-out zero-shot top-1 %.1f%% is not far above chance (5%%): want >= 15%%", acc);
    snprintf(cmd, sizeof(cmd), "eval --model %s --val-data va/own.csv --few-shot 0", ck);
    expect(cmd, 0, "retrieval on va/own.csv");
    // the same with the normalisation typed again (equal: accepted), or contradicted (refused)
    snprintf(cmd, sizeof(cmd), "eval --model %s --zeroshot-data va/classes --classnames classnames.txt --few-shot 0 "
             "--image-mean 0.5,0.5,0.5", ck);
    expect(cmd, 0, "zero-shot on va/classes");
    snprintf(cmd, sizeof(cmd), "eval --model %s --zeroshot-data va/classes --few-shot 0 --image-mean 0.4", ck);
    expect(cmd, 1, "contradicts the mean 0.5,0.5,0.5");
    snprintf(cmd, sizeof(cmd), "eval --model %s --zeroshot-data va/classes --classnames classnames.txt --few-shot 0 "
             "--image-mean 0.4 --override-inputs", ck);
    expect(cmd, 0, "--override-inputs: normalising with --image-mean 0.4,0.4,0.4");
    snprintf(cmd, sizeof(cmd), "eval --model %s --val-data va/own.csv --tokenizer runs/own/tokenizer.txt", ck);
    expect(cmd, 0, "retrieval on va/own.csv"); // the same tokenizer typed again
    test_write_file(test_path(dir, "other.txt"), "#version: 0.2\nz o\n", 18);
    snprintf(cmd, sizeof(cmd), "eval --model %s --val-data va/own.csv --tokenizer other.txt", ck);
    expect(cmd, 1, "carries its own tokenizer");
    // no data flag: the synthetic data says nothing about this model
    snprintf(cmd, sizeof(cmd), "eval --model %s", ck);
    expect(cmd, 1, "give --val-data FILE or --zeroshot-data DIR");
    snprintf(cmd, sizeof(cmd), "eval --model %s --dataset-type synthetic", ck);
    expect(cmd, 1, "not on the synthetic data");

    // classify and embed
    char labels[1024] = "", line[64];
    FILE *cf = fopen(test_path(dir, "classnames.txt"), "r");
    while (cf && fgets(line, sizeof(line), cf)) {
        line[strcspn(line, "\n")] = 0;
        snprintf(labels + strlen(labels), sizeof(labels) - strlen(labels), "%s%s", labels[0] ? "," : "", line);
    }
    if (cf) fclose(cf);
    snprintf(cmd, sizeof(cmd), "classify --model %s --image va/classes/red_circle/000000.png --labels \"%s\"", ck, labels);
    expect(cmd, 0, "va/classes/red_circle/000000.png:");
    test_write_file(test_path(dir, "texts.txt"), "zovobi vaveza\n", 14);
    snprintf(cmd, sizeof(cmd), "embed --model %s --texts texts.txt -o t.safetensors", ck);
    expect(cmd, 0, "text_embeds (1, 64)");
    snprintf(cmd, sizeof(cmd), "embed --model %s --images va/classes/red_circle -o i.safetensors", ck);
    expect(cmd, 0, "image_embeds");

    // prune: the synthetic data cannot rank its experts; the run's metrics can, and the pruned
    // model still carries the inputs
    snprintf(cmd, sizeof(cmd), "prune --model %s --modality image --keep 4 -o p.safetensors", ck);
    expect(cmd, 1, "give --stats RUN/metrics.jsonl");
    snprintf(cmd, sizeof(cmd), "prune --model %s --modality image --keep 4 -o p.safetensors --stats runs/own/metrics.jsonl", ck);
    expect(cmd, 0, "pruned model");
    expect("eval --model p.safetensors --zeroshot-data va/classes --classnames classnames.txt --few-shot 0", 0,
           "zero-shot on va/classes");
    // ... and so can the user's own images or texts, read as the model records
    snprintf(cmd, sizeof(cmd), "prune --model %s --modality image --keep 4 -o pi.safetensors --images va/classes", ck);
    expect(cmd, 0, "image shares measured on 400 images of va/classes");
    snprintf(cmd, sizeof(cmd), "prune --model %s --modality text --keep 4 -o pt.safetensors --texts texts.txt", ck);
    expect(cmd, 0, "text shares measured on 1 texts of texts.txt");
    snprintf(cmd, sizeof(cmd), "prune --model %s --modality text --keep 4 -o x.safetensors --images va/classes", ck);
    expect(cmd, 1, "--images measures image tokens: give --modality image");
    // soup: uniform is fine, greedy scores on the synthetic data
    snprintf(cmd, sizeof(cmd), "soup %s %s -o s.safetensors --greedy", ck, ck);
    expect(cmd, 1, "give --zeroshot-data DIR to score the greedy soup on");
    snprintf(cmd, sizeof(cmd), "soup %s %s -o g.safetensors --greedy --zeroshot-data va/classes --classnames "
             "classnames.txt", ck, ck);
    expect(cmd, 0, "zero-shot top-1");
    CHECK(strstr(out, "written to g.safetensors"), "a greedy soup scored on the user's folder:\n%s", out);
    // LIMoE A.3's variant, scored with the user's own prompts
    test_write_file(test_path(dir, "tpl.txt"), "a photo of a {}.\nthis is a {}.\n", 31);
    snprintf(cmd, sizeof(cmd), "soup %s %s -o gr.safetensors --greedy --reuse --max-ingredients 3 --zeroshot-data "
             "va/classes --classnames classnames.txt --zeroshot-templates tpl.txt", ck, ck);
    expect(cmd, 0, "zero-shot top-1");
    CHECK(strstr(out, "written to gr.safetensors: ") && strstr(out, " x"), "a greedy soup with reuse:\n%s", out);
    snprintf(cmd, sizeof(cmd), "soup %s %s -o s.safetensors --greedy --zeroshot-templates tpl.txt", ck, ck);
    expect(cmd, 1, "--zeroshot-templates applies to --zeroshot-data DIR");
    snprintf(cmd, sizeof(cmd), "soup %s %s -o s.safetensors", ck, ck);
    expect(cmd, 0, "soup of 2 checkpoints");
    char *sk = metadata("s.safetensors", "vlmoe.tokenizer");
    CHECK(sk && !strcmp(sk, "bpe"), "the soup carries the tokenizer");
    free(sk);

    // a resumed run with no tokenizer or normalisation flag continues with the checkpoint's
    snprintf(cmd, sizeof(cmd), "train --model limoe-tiny --train-data tr/own.csv --steps %d --batch-size 64 --logs runs "
             "--name own --resume latest", steps + 4);
    expect(cmd, 0, "resuming from");
    CHECK(!strstr(out, "trained a BPE vocabulary"), "the resumed run trained no vocabulary:\n%s", out);
    snprintf(ck, sizeof(ck), "runs/own/checkpoints/step_%d.safetensors", steps + 4);
    pre = metadata(ck, "vlmoe.preprocess"), text = metadata(ck, "vlmoe.tokenizer.text");
    CHECK(pre && strstr(pre, "\"mean\": [0.5, 0.5, 0.5]"), "the resumed run normalised as the checkpoint says");
    CHECK(text && trained && !strcmp(text, trained), "the resumed run kept the tokenizer");
    free(pre), free(text);

    // --pretrained on the same captions: the pretrained model's tokenizer, not a new vocabulary
    snprintf(cmd, sizeof(cmd), "train --pretrained %s --train-data tr/own.csv --steps 2 --batch-size 16 --logs runs "
             "--name ft", ck);
    expect(cmd, 0, "trained to step 2");
    CHECK(!strstr(out, "trained a BPE vocabulary"), "--pretrained trained no vocabulary:\n%s", out);
    text = metadata("runs/ft/checkpoints/step_2.safetensors", "vlmoe.tokenizer.text");
    CHECK(text && trained && !strcmp(text, trained), "--pretrained kept the pretrained tokenizer");
    free(text);
    // ... nor the synthetic data for a model of captions, nor a contradicting tokenizer
    snprintf(cmd, sizeof(cmd), "train --pretrained %s --steps 2 --batch-size 16 --logs runs --name ft2", ck);
    expect(cmd, 1, "give --train-data");
    expect("train --model limoe-tiny --steps 2 --batch-size 16 --logs runs --name s --tokenizer runs/own/tokenizer.txt", 1,
           "the synthetic data has its own word tokenizer");

    // a config that fixes the vocabulary: too small for BPE, or smaller than the tokenizer
    test_write_file(test_path(dir, "v256.json"), "{\"base\": \"limoe-tiny\", \"vocab_size\": 256}", 41);
    expect("train --model v256.json --train-data tr/own.csv --steps 1 --logs runs --name v", 1,
           "v256.json fixes vocab_size 256, too small");
    test_write_file(test_path(dir, "v600.json"), "{\"base\": \"limoe-tiny\", \"vocab_size\": 600}", 41);
    expect("train --model v600.json --train-data tr/own.csv --tokenizer runs/own/tokenizer.txt --steps 1 --logs runs "
           "--name v", 1, "has 1024 ids, more than the 600 of vocab_size in v600.json");

    // a model of the synthetic data records that, and behaves as before
    expect("train --model tiny --steps 2 --batch-size 8 --logs runs --name syn --eval-samples 40", 0, "trained to step 2");
    kind = metadata("runs/syn/checkpoints/step_2.safetensors", "vlmoe.tokenizer");
    CHECK(kind && !strcmp(kind, "synthetic"), "a synthetic run records the synthetic tokenizer");
    free(kind);
    pre = metadata("runs/syn/checkpoints/step_2.safetensors", "vlmoe.preprocess");
    CHECK(pre && strstr(pre, "\"mean\": [0.5, 0.5, 0.5]"), "a synthetic run records the [-1, 1] pixels' normalisation, "
          "which reads vlmoe synth export's files: %s", pre ? pre : "(none)");
    free(pre);
    expect("eval --model runs/syn/checkpoints/step_2.safetensors --samples 64 --few-shot 0", 0, "zero-shot");
    expect("train --pretrained runs/syn/checkpoints/step_2.safetensors --train-data tr/own.csv --steps 1 --logs runs "
           "--name syn2", 1, "whose word tokenizer cannot read captions");

    // model files whose recorded inputs are corrupt are refused, naming the file and the entry
    patch(ck, "bad1.safetensors", "\\\"crop\\\": \\\"center\\\"", "\\\"crop\\\": \\\"random\\\"");
    expect("eval --model bad1.safetensors --zeroshot-data va/classes", 1, "bad1.safetensors: metadata vlmoe.preprocess: "
           "\"crop\" is \"random\"");
    patch(ck, "bad2.safetensors", "\\\"std\\\": [0.5, 0.5, 0.5]", "\\\"std\\\": [0.5, 0.0, 0.5]");
    expect("eval --model bad2.safetensors --zeroshot-data va/classes", 1, "\"std\" must be 3 finite numbers > 0");
    patch(ck, "bad3.safetensors", "\"vlmoe.tokenizer\":\"bpe\"", "\"vlmoe.tokenizer\":\"xyz\"");
    expect("eval --model bad3.safetensors --zeroshot-data va/classes", 1, "metadata vlmoe.tokenizer is \"xyz\"");
    patch(ck, "bad4.safetensors", "\"vlmoe.tokenizer.text\":", "\"vlmoe.tokenizer.tekt\":");
    expect("eval --model bad4.safetensors --zeroshot-data va/classes", 1, "is \"bpe\" but vlmoe.tokenizer.text is missing");
    free(trained);
    return test_summary("test_own_data");
}
