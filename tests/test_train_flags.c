// test_train_flags.c: the flags of `vlmoe train` as OpenCLIP users know them (cli/train.c,
// cli/train_flags.c): --save-frequency counts epochs (--save-every-n-steps steps), --image-mean
// takes three values in train and eval, --resume refuses changed flags naming both values unless
// --resume-allow-changes (then logged, params.json untouched), a limoe-* run older than LIMoE's
// recipe and --precision resumes with its AdamW and fp32, a JSON config's run carries the
// file's name, and flags that do not apply are errors. Runs $VLMOE_BIN (or $VLMOE_BIN_ASAN), as
// tests/run.sh sets them; the VL-MoE trainer's side is in tests/test_vlmoe_train.c.
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "test.h"

static const char *bin;
static char dir[64], out[16384];

// A failed check unless `vlmoe ARGS` exits with status and prints needle; a sanitizer report
// (whose exit status may be the 1 an error has) is a failure too.
static int expect(const char *args, int status, const char *needle) {
    const int st = test_expect_in(dir, bin, args, status, needle, out, sizeof(out));
    CHECK(!strstr(out, "Sanitizer") && !strstr(out, "runtime error:"), "`vlmoe %s`:\n%s", args, out);
    return st;
}

#define P(rel) test_path(dir, rel)

// Which of steps 1..n have a checkpoint in runs/NAME, as a string of 0/1 ("001001").
static const char *saved(const char *name, int n) {
    static char s[64];
    for (int i = 1; i <= n && i < 64; i++) {
        char rel[256];
        snprintf(rel, sizeof(rel), "runs/%s/checkpoints/step_%d.safetensors", name, i);
        s[i - 1] = access(P(rel), R_OK) == 0 ? '1' : '0';
    }
    s[n] = 0;
    return s;
}

static void test_save_frequency(void) {
    // 48 synthetic samples an epoch at a batch of 16: 3 steps an epoch, 6 in 2 epochs
    expect("train --model tiny --train-num-samples 48 --batch-size 16 --epochs 2 --save-frequency 1 "
           "--keep-checkpoints 0 --eval-samples 0 --logs runs --name ep", 0, "trained to step 6");
    CHECK(!strcmp(saved("ep", 6), "001001"), "--save-frequency 1 --epochs 2: checkpoints %s, want 001001 (steps 3, 6)",
          saved("ep", 6));
    expect("train --model tiny --steps 5 --batch-size 8 --save-every-n-steps 2 --keep-checkpoints 0 --eval-samples 0 "
           "--logs runs --name st", 0, "trained to step 5");
    CHECK(!strcmp(saved("st", 5), "01011"), "--save-every-n-steps 2: checkpoints %s, want 01011", saved("st", 5));
    // an epoch of a CSV is its rows: 40 rows at 16 a step are 3 steps; three-value normalisation
    expect("synth export --out shapes --n 40", 0, "");
    expect("train --model tiny --train-data shapes/captions.csv --image-mean 0.5 0.5 0.5 --image-std 0.5 0.5 0.5 "
           "--batch-size 16 --epochs 2 --save-frequency 1 --keep-checkpoints 0 --workers 1 "
           "--logs runs --name csv", 0, "trained to step 6");
    CHECK(!strcmp(saved("csv", 6), "001001"), "CSV of 40 rows, 2 epochs: checkpoints %s, want 001001", saved("csv", 6));
    char *pj = test_read_file(P("runs/csv/params.json"), NULL);
    CHECK(pj && strstr(pj, "\"image_mean\":\t\"0.5,0.5,0.5\"") && strstr(pj, "\"save_frequency\":\t1"),
          "params.json of the CSV run:\n%s", pj ? pj : "(none)");
    free(pj);
    char cmd[512]; // shards: their samples are not counted before reading them
    snprintf(cmd, sizeof(cmd), "cd %s/shapes && tar cf x-0.tar texts.txt && tar cf x-1.tar texts.txt", dir);
    CHECK(system(cmd) == 0, "%s", cmd);
    expect("train --model tiny --train-data 'shapes/x-{0..1}.tar' --save-frequency 1 --steps 2", 1,
           "give --train-num-samples");
    expect("train --model tiny --save-frequency 1 --save-every-n-steps 2 --steps 2", 1, "not both");
}

static void test_image_mean(void) {
    static char a[sizeof(out)], b[sizeof(out)];
    // a model of its own (in flags every vlmoe takes), so that this test fails only on --image-mean
    expect("train --model tiny --train-data shapes/captions.csv --image-mean 0.5 --image-std 0.5 --steps 2 "
           "--batch-size 8 --workers 1 --logs runs --name ev", 0, "trained to step 2");
    const char *m = "eval --model runs/ev/checkpoints/step_2.safetensors --val-data shapes/captions.csv --few-shot 0 "
                    "--batch-size 20 --json";
    char args[1024];
    // the model records 0.5: other values need --override-inputs, in either form
    snprintf(args, sizeof(args), "%s --image-mean 0.4 0.45 0.5 --image-std 0.3 0.3 0.3 --override-inputs", m);
    expect(args, 0, "--override-inputs: normalising with --image-mean 0.4,0.45,0.5");
    memcpy(a, out, sizeof(out));
    snprintf(args, sizeof(args), "%s --image-mean=0.4,0.45,0.5 --image-std 0.3 --override-inputs", m);
    expect(args, 0, "retrieval");
    memcpy(b, out, sizeof(out));
    CHECK(!strcmp(a, b), "--image-mean 0.4 0.45 0.5 and 0.4,0.45,0.5 differ:\n%s\nvs\n%s", a, b);
    expect(m, 0, "retrieval"); // the recorded 0.5: other pixels, other embeddings
    CHECK(strcmp(a, out), "--image-mean 0.4 0.45 0.5 made no difference to eval:\n%s", a);
    snprintf(args, sizeof(args), "%s --image-mean 0.5 0.5 0.5 --image-std 0.5 0.5 0.5", m); // the recorded values
    expect(args, 0, "retrieval");
    CHECK(!strstr(out, "--override-inputs"), "the recorded values typed again are no override:\n%s", out);
    snprintf(args, sizeof(args), "%s --image-mean 0.5 0.4", m);
    expect(args, 1, "--image-mean expects R,G,B");
    // an image path after one value is not taken for a value
    expect("embed --model runs/ev/checkpoints/step_2.safetensors --image-mean 0.5 shapes/classes -o e.safetensors",
           2, "unexpected argument");
    expect("embed --model runs/ev/checkpoints/step_2.safetensors --image-mean 0.5 0.5 0.5 --images shapes/classes "
           "-o e.safetensors", 0, "");
}

// The resume of run "r" (batch 16, lr 1e-3, seed 0, model tiny) with changed flags.
static void test_resume(void) {
    const char *base = "train --steps 2 --eval-samples 0 --logs runs --name r";
    char args[1024];
    snprintf(args, sizeof(args), "%s --model tiny --batch-size 16", base);
    expect(args, 0, "trained to step 2");
    char *first = test_read_file(P("runs/r/params.json"), NULL);
    static const char *const change[][2] = {
        {"--lr 0.002", "--lr 0.002 differs from the run's 0.001 (params.json of runs/r)"},
        {"--batch-size 8", "--batch-size 8 differs from the run's 16"},
        {"--model limoe-tiny", "--model limoe-tiny differs from the run's tiny"},
        {"--seed 7", "--seed 7 differs from the run's 0"},
        {"--lr-scheduler const", "--lr-scheduler const differs from the run's cosine"},
    };
    for (int i = 0; i < 5; i++) {
        snprintf(args, sizeof(args), "%s --steps 4 --resume latest --model tiny --batch-size 16 %s", base, change[i][0]);
        expect(args, 1, change[i][1]);
    }
    snprintf(args, sizeof(args), "%s --steps 4 --resume latest --model tiny --batch-size 16", base);
    expect(args, 0, "trained to step 4"); // the same flags, --steps raised: fine
    snprintf(args, sizeof(args), "%s --steps 5 --resume latest --model tiny --batch-size 16 --lr 0.002 --seed 7 "
             "--resume-allow-changes", base);
    expect(args, 0, "warning: --resume-allow-changes: --lr 0.002 differs from the run's 0.001");
    CHECK(strstr(out, "--seed 7 differs from the run's 0") && strstr(out, "trained to step 5"), "%s", out);
    char *again = test_read_file(P("runs/r/params.json"), NULL), *res = test_read_file(P("runs/r/params_resumed.json"), NULL);
    CHECK(first && again && !strcmp(first, again), "params.json changed on resume");
    CHECK(res && strstr(res, "\"resumed_with_changes\"") && strstr(res, "\"step\":\t4") &&
              strstr(res, "--lr 0.002 differs from the run's 0.001") && strstr(res, "\"lr\":\t0.002"),
          "params_resumed.json:\n%s", res ? res : "(none)");
    free(first), free(again), free(res);
    // the record is now the resumed run's: its flags go on, the first ones are a change
    snprintf(args, sizeof(args), "%s --steps 6 --resume latest --model tiny --batch-size 16 --lr 0.002 --seed 7", base);
    expect(args, 0, "trained to step 6");
    snprintf(args, sizeof(args), "%s --steps 7 --resume latest --model tiny --batch-size 16", base);
    expect(args, 1, "--lr 0.001 differs from the run's 0.002 (params_resumed.json of runs/r)");
    expect("train --steps 2 --resume-allow-changes --logs runs --name q", 1, "--resume-allow-changes applies to --resume");
}

// Two checkpoint files hold the same tensors, bit for bit (their metadata differ: every save has
// its own run and save ids).
static int same_tensors(const char *a, const char *b) {
    vlmoe_st *x = NULL, *y = NULL;
    int same = !vlmoe_st_open(P(a), &x) && !vlmoe_st_open(P(b), &y) && vlmoe_st_count(x) == vlmoe_st_count(y);
    for (int i = 0; same && i < vlmoe_st_count(x); i++) {
        vlmoe_tensor_info p, q;
        same = !vlmoe_st_info(x, i, &p) && !vlmoe_st_info(y, i, &q) && !strcmp(p.name, q.name) &&
               p.nbytes == q.nbytes && !memcmp(p.data, q.data, p.nbytes);
    }
    vlmoe_st_close(x), vlmoe_st_close(y);
    return same;
}

// A limoe-* run from before LIMoE's recipe (Adafactor, wd 1e-5, bf16 momentum) became its default
// and before --precision: its params.json records AdamW and wd 0.1 and has no "precision". Resumed
// without optimizer flags it goes on with AdamW (bit for bit as the run that never stopped), not
// the recipe; --precision bf16 is a change from the fp32 it ran with.
static void test_resume_old(void) {
    const char *flags = "train --model limoe-tiny --batch-size 8 --eval-samples 0 --logs runs --threads 1";
    char args[1024];
    snprintf(args, sizeof(args), "%s --optimizer adamw --wd 0.1 --steps 4 --name oldfull", flags);
    expect(args, 0, "trained to step 4");
    snprintf(args, sizeof(args), "%s --optimizer adamw --wd 0.1 --steps 2 --name old", flags);
    expect(args, 0, "trained to step 2");
    test_json_drop_key(P("runs/old/params.json"), "precision");
    snprintf(args, sizeof(args), "%s --steps 4 --name old --resume latest --precision bf16", flags);
    expect(args, 1, "--precision bf16 differs from the run's fp32 (params.json of runs/old has no precision");
    snprintf(args, sizeof(args), "%s --steps 4 --name old --resume latest", flags);
    expect(args, 0, "trained to step 4");
    CHECK(same_tensors("runs/old/checkpoints/step_4.safetensors", "runs/oldfull/checkpoints/step_4.safetensors") &&
              same_tensors("runs/old/checkpoints/step_4.state.safetensors",
                           "runs/oldfull/checkpoints/step_4.state.safetensors"),
          "a resumed AdamW limoe-tiny run differs from the one that never stopped: it took another optimizer");
    // the values the resumed run took, in the record a change writes
    snprintf(args, sizeof(args), "%s --steps 5 --name old --resume latest --seed 3 --resume-allow-changes", flags);
    expect(args, 0, "trained to step 5");
    char *res = test_read_file(P("runs/old/params_resumed.json"), NULL);
    CHECK(res && strstr(res, "\"optimizer\":\t\"adamw\"") && strstr(res, "\"wd\":\t0.1,") &&
              strstr(res, "\"precision\":\t\"fp32\"") && !strstr(res, "momentum_dtype"),
          "params_resumed.json of a resumed pre-recipe run:\n%s", res ? res : "(none)");
    free(res);
}

static void test_config_name(void) {
    const char *cfg = "{\"base\": \"tiny\", \"embed_dim\": 32}";
    test_write_file(P("mine.json"), cfg, strlen(cfg));
    expect("train --model mine.json --steps 1 --batch-size 8 --eval-samples 0 --logs named", 0, "model mine (");
    char cmd[512];
    snprintf(cmd, sizeof(cmd), "ls %s/named", dir);
    FILE *p = popen(cmd, "r");
    char line[256] = "";
    if (p && !fgets(line, sizeof(line), p)) line[0] = 0;
    if (p) pclose(p);
    CHECK(strstr(line, "-model_mine-lr_0.001-b_8") != NULL, "run folder of mine.json: %s", line);
    expect("train --model mine.json --steps 1 --batch-size 8 --eval-samples 0 --logs runs --name mine", 0, "trained");
    char *c = test_read_file(P("runs/mine/config.json"), NULL);
    CHECK(c && strstr(c, "\"name\":\t\"mine\""), "config.json of mine.json:\n%s", c ? c : "(none)");
    free(c);
    const char *own = "{\"base\": \"tiny\", \"name\": \"own-name\"}";
    test_write_file(P("x.json"), own, strlen(own));
    expect("train --model x.json --steps 1 --batch-size 8 --eval-samples 0 --logs runs --name x", 0, "model own-name (");
}

// Whether runs/NAME/params.json holds every "key":<tab>value of `want` (NULL-terminated).
static void params_hold(const char *name, const char *const *want) {
    char rel[256];
    snprintf(rel, sizeof(rel), "runs/%s/params.json", name);
    char *pj = test_read_file(P(rel), NULL);
    for (int i = 0; want[i]; i++)
        CHECK(pj && strstr(pj, want[i]), "params.json of %s lacks %s:\n%s", name, want[i], pj ? pj : "(none)");
    free(pj);
}

// The papers' recipes: LIMoE's (app. A: Adafactor as ViT-G, lr 1e-3, decay 1e-5, images in
// [-1, 1]) for --preset limoe and the limoe-* models, CLIP-UP's (AdamW, 5e-5, 0.05); flags
// given win; params.json records what was resolved.
static void test_paper_recipe(void) {
    const char *base = "--steps 1 --batch-size 8 --eval-samples 0 --logs runs";
    char cmd[512];
    snprintf(cmd, sizeof(cmd), "train --model limoe-tiny %s --name lim", base);
    expect(cmd, 0, "trained to step 1");
    params_hold("lim", (const char *const[]){"\"optimizer\":\t\"adafactor\"", "\"lr\":\t0.001", "\"wd\":\t1e-05",
                                             "\"beta1\":\t0.9", "\"momentum_dtype\":\t\"bfloat16\"", NULL});
    snprintf(cmd, sizeof(cmd), "train --model clipup-tiny --preset limoe --optimizer adamw --lr 0.002 %s --name limw", base);
    expect(cmd, 0, "trained to step 1");
    params_hold("limw", (const char *const[]){"\"optimizer\":\t\"adamw\"", "\"lr\":\t0.002", "\"wd\":\t0.1", NULL});
    snprintf(cmd, sizeof(cmd), "train --model clipup-tiny %s --name cup", base);
    expect(cmd, 0, "trained to step 1");
    params_hold("cup", (const char *const[]){"\"optimizer\":\t\"adamw\"", "\"lr\":\t5e-05", "\"wd\":\t0.05", NULL});
    // --beta1 with Adafactor is its momentum, honoured (0 is none)
    snprintf(cmd, sizeof(cmd), "train --model tiny --optimizer adafactor --beta1 0.5 %s --name af", base);
    expect(cmd, 0, "trained to step 1");
    params_hold("af", (const char *const[]){"\"beta1\":\t0.5", "\"momentum_dtype\":\t\"float32\"", "\"wd\":\t1e-05", NULL});
    // LIMoE's [-1, 1] images on the user's data (shapes/ from test_save_frequency)
    expect("train --model limoe-tiny --train-data shapes/captions.csv --steps 1 --batch-size 8 --workers 0 --logs runs "
           "--name limcsv", 0, "trained to step 1");
    params_hold("limcsv", (const char *const[]){"\"image_mean\":\t\"0.5,0.5,0.5\"", "\"image_std\":\t\"0.5,0.5,0.5\"", NULL});
    expect("train --momentum-dtype bfloat16 --steps 1", 1, "--momentum-dtype applies to --optimizer adafactor");
    expect("train --optimizer adafactor --beta1 0 --momentum-dtype bfloat16 --steps 1", 1, "with momentum (--beta1 > 0)");
    expect("train --optimizer adafactor --momentum-dtype f16 --steps 1", 1, "--momentum-dtype f16: expected float32 or bfloat16");
    expect("train --optimizer adafactor --beta1 1 --steps 1", 2, "--beta1 must be in [0, 1), got '1'");
}

static void test_inapplicable(void) {
    expect("train --tokenizer t.txt --steps 1", 1, "the synthetic data has its own word tokenizer");
    expect("train --image-mean 0.5 --steps 1", 1, "--image-mean applies to image files: --train-data");
    expect("train --workers 3 --steps 1", 1, "--workers applies to --train-data");
    expect("train --codebook cb.safetensors --steps 1", 1, "--codebook applies to VL-MoE (arch mome) models");
    expect("train --lr-cooldown-steps 5 --steps 1", 1, "--lr-cooldown-steps applies to --lr-scheduler rsqrt");
    expect("train --optimizer adafactor --beta2 0.99 --steps 1", 1, "--beta2 applies to --optimizer adamw");
    expect("train --model vlmoe-tiny --zeroshot-frequency 5 --steps 1", 1, "--zeroshot-frequency: the VL-MoE trainer (arch mome models) has no validation");
    expect("train --help", 0, "loss L (avg A)");
    CHECK(strstr(out, "acc I/T  T t") && strstr(out, "--resume-allow-changes"), "train --help:\n%s", out);
    expect("train --model vlmoe-tiny --help", 0, "MIM L (acc A)");
}

int main(int argc, char **argv) {
    static char abs[4096];
    if (!(bin = test_vlmoe_bin(argv[0], abs))) return test_summary("test_train_flags");
    snprintf(dir, sizeof(dir), "/tmp/vlmoe_flags_XXXXXX");
    CHECK(mkdtemp(dir) != NULL, "mkdtemp");
    test_save_frequency();
    test_image_mean();
    test_resume();
    test_resume_old();
    test_config_name();
    test_inapplicable();
    test_paper_recipe();
    char cmd[256];
    snprintf(cmd, sizeof(cmd), "rm -rf %s", dir);
    CHECK(system(cmd) == 0, "cleanup");
    return test_summary("test_train_flags");
}
