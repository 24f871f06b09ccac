// test_cli.c: the vlmoe command as a user meets it: bad flags, unknown models, broken config
// files and corrupt checkpoints each give one clear message and a non-zero exit (never a crash),
// and a short training run writes its run folder. Runs the binary named by $VLMOE_BIN (or
// $VLMOE_BIN_ASAN when this test is the sanitizer build), as tests/run.sh sets them.
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "test.h"

static const char *bin;
static char dir[64], out[8192];

static void write_file(const char *name, const char *text, size_t n) {
    char path[256];
    snprintf(path, sizeof(path), "%s/%s", dir, name);
    FILE *f = fopen(path, "wb");
    fwrite(text, 1, n, f);
    fclose(f);
}

static void expect(const char *args, int status, const char *needle) {
    test_expect_in(dir, bin, args, status, needle, out, sizeof(out));
}

int main(int argc, char **argv) {
    static char abs[4096];
    if (!(bin = test_vlmoe_bin(argv[0], abs))) return test_summary("test_cli");
    snprintf(dir, sizeof(dir), "/tmp/vlmoe_cli_XXXXXX");
    CHECK(mkdtemp(dir) != NULL, "mkdtemp");
    expect("frobnicate", 2, "unknown command 'frobnicate'");
    expect("train --bogus 1", 2, "unknown flag '--bogus'");
    expect("train --steps abc", 2, "--steps expects an integer, got 'abc'");
    expect("train --steps", 2, "--steps needs a value");
    expect("train --model nosuch", 1, "unknown model 'nosuch'");
    expect("train --model missing.json", 1, "missing.json: cannot open config file");
    const char *no_key = "{\"arch\": \"one_tower\", \"image_size\": 32}";
    write_file("nokey.json", no_key, strlen(no_key));
    expect("train --model nokey.json", 1, "nokey.json: missing key");
    const char *bad_type = "{\"base\": \"tiny\", \"embed_dim\": \"big\"}";
    write_file("badtype.json", bad_type, strlen(bad_type));
    expect("train --model badtype.json", 1, "badtype.json: key \"embed_dim\" must be an integer");
    write_file("corrupt.safetensors", "\x10\x00\x00\x00\x00\x00\x00\x00{\"a\":", 13);
    expect("train --pretrained corrupt.safetensors", 1, "corrupt.safetensors");
    write_file("empty.safetensors", "", 0);
    expect("train --pretrained empty.safetensors", 1, "empty.safetensors");
    expect("train --help", 0, "--batch-size");
    // --device: cpu is the default; cuda without a CUDA build (or without a device) says why
    expect("train --device gpu --steps 1 --logs runs", 1, "expected cpu, cuda or cuda:N");
    expect("train --device cuda:x --steps 1 --logs runs", 1, "expected cuda:N with N a device number");
    expect("train --device cuda --steps 1 --logs runs", 1, "cuda");
    // experts split over groups of processes need those processes
    expect("train --model limoe-tiny --steps 1 --expert-parallel 2 --logs runs", 1, "start several with mpirun");
    expect("train --model limoe-tiny --steps 1 --expert-parallel -1 --logs runs", 2, "--expert-parallel must be >= 1");
    // Soft MoE's App. A baselines and App. E's variant (issue 20), and their errors
    expect("train --model soft-tiny --steps 1 --soft-dispatch hard --logs runs", 1, "--soft-dispatch hard: must be soft");
    expect("train --model limoe-tiny --steps 1 --soft-dispatch uniform --logs runs", 1, "has no Soft MoE layers");
    expect("train --model soft-tiny --steps 1 --soft-dispatch identity --logs runs", 1, "as many slots");
    expect("train --model soft-tiny --steps 1 --batch-size 4 --soft-dispatch uniform_soft --no-soft-normalize "
           "--eval-samples 8 --logs runs --name softu", 0, "held-out");
    const char *p0 = "{\"base\": \"soft-tiny\", \"moe\": {\"num_experts\": 80, \"slots_per_expert\": 0}}";
    write_file("p0.json", p0, strlen(p0));
    expect("train --model p0.json --steps 1 --logs runs", 1, "0 slots per expert");
    // a global-entropy threshold no routing over 8 experts meets is warned about (tau = log 9)
    const char *t9 = "{\"base\": \"limoe-tiny\", \"moe\": {\"preset\": \"limoe\", \"global_entropy_tau\": "
                     "[0, 2.1972245773362196]}}";
    write_file("t9.json", t9, strlen(t9));
    expect("train --model t9.json --steps 1 --batch-size 4 --eval-samples 8 --logs runs --name t9", 0,
           "warning: moe.global_entropy_tau[text] = 2.19722 = log(9)");
    // a real (short) run, then training on from its checkpoint
    expect("train --model tiny --steps 4 --batch-size 8 --log-every-n-steps 2 --eval-samples 40 "
           "--logs runs --name a", 0, "held-out: zero-shot top-1");
    char path[256];
    snprintf(path, sizeof(path), "%s/runs/a/metrics.jsonl", dir);
    FILE *f = fopen(path, "r");
    int lines = 0;
    char line[4096];
    while (f && fgets(line, sizeof(line), f)) lines += strstr(line, "\"loss\"") != NULL;
    if (f) fclose(f);
    CHECK(lines == 2, "metrics.jsonl has %d step lines, expected 2", lines);
    expect("train --pretrained runs/a/checkpoints/step_4.safetensors --steps 2 --batch-size 8 "
           "--eval-samples 0 --logs runs --name b", 0, "trained to step 2");
    // eval and soup on the checkpoints just written
    expect("eval --model runs/a/checkpoints/step_4.safetensors --samples 64 --batch-size 32 --few-shot 2",
           0, "zero-shot (20 classes, 6 prompt templates): top-1");
    expect("eval --model runs/a/checkpoints/step_4.safetensors --samples 64 --batch-size 32 --few-shot 0 --json",
           0, "\"retrieval\":{\"i2t_R@1\":");
    expect("eval --model corrupt.safetensors", 1, "corrupt.safetensors");
    expect("eval", 1, "--model is required");
    expect("soup runs/a/checkpoints/step_4.safetensors runs/b/checkpoints/step_2.safetensors -o soup.safetensors",
           0, "soup of 2 checkpoints written to soup.safetensors");
    expect("soup runs/a/checkpoints/step_4.safetensors runs/b/checkpoints/step_2.safetensors -o g.safetensors "
           "--greedy --eval-samples 40", 0, "written to g.safetensors");
    // greedy soup with reuse (LIMoE A.3): shares that add up to the soup's size, each addition a
    // strict improvement; capped by --max-ingredients (1: the best ingredient alone)
    expect("soup runs/a/checkpoints/step_4.safetensors runs/b/checkpoints/step_2.safetensors -o r.safetensors "
           "--greedy --reuse --max-ingredients 4 --eval-samples 40", 0, "written to r.safetensors");
    {
        int size = 0, shares = 0, k = 0;
        const char *w = strstr(out, "soup of ");
        CHECK(w && sscanf(w, "soup of %d", &size) == 1 && size >= 1 && size <= 4, "--reuse soup size:\n%s", out);
        for (const char *x = w ? strstr(w, " x") : NULL; x && sscanf(x, " x%d", &k) == 1; x = strstr(x + 2, " x")) shares += k;
        CHECK(shares == size, "--reuse: shares add up to %d, the soup holds %d:\n%s", shares, size, out);
        double prev = -1, s = 0;
        for (const char *x = strstr(out, "-> "); x && sscanf(x, "-> %lf", &s) == 1; x = strstr(x + 3, "-> ")) {
            CHECK(s > prev, "--reuse: an addition that does not improve the soup (%.2f after %.2f):\n%s", s, prev, out);
            prev = s;
        }
    }
    expect("soup runs/a/checkpoints/step_4.safetensors runs/b/checkpoints/step_2.safetensors -o r1.safetensors "
           "--greedy --reuse --max-ingredients 1 --eval-samples 40", 0, "soup of 1 checkpoint written to r1.safetensors");
    expect("soup runs/a/checkpoints/step_4.safetensors runs/b/checkpoints/step_2.safetensors -o r.safetensors --reuse",
           1, "shape a greedy soup: add --greedy");
    expect("soup runs/a/checkpoints/step_4.safetensors runs/b/checkpoints/step_2.safetensors -o r.safetensors --greedy "
           "--max-ingredients 3", 1, "--max-ingredients applies to --reuse");
    expect("soup runs/a/checkpoints/step_4.safetensors runs/b/checkpoints/step_2.safetensors -o "
           "runs/b/checkpoints/step_2.safetensors", 1, "is the same file as the checkpoint");
    expect("soup --help", 0, "Checkpoints\ncould be reused multiple times");
    expect("train --model limoe-tiny --steps 1 --batch-size 8 --eval-samples 0 --logs runs --name moe", 0, "trained");
    expect("soup runs/a/checkpoints/step_4.safetensors runs/moe/checkpoints/step_1.safetensors -o x.safetensors",
           1, "another config");
    // LIMoE E.4: image and text experts pruned independently in one evaluation; keeping them all
    // is the unpruned model's zero-shot top-1 on the same held-out samples
    expect("prune --model runs/moe/checkpoints/step_1.safetensors --keep-image 1,all --keep-text 2,all --eval-samples 64",
           0, "image\\text       2       8");
    {
        double cells[4] = {-1, -1, -1, -1}, ev = -2;
        const char *row = strstr(out, "\n         1 ");
        CHECK(row && sscanf(row, " 1 %lf%% %lf%%", &cells[0], &cells[1]) == 2, "E.4 grid, row 1:\n%s", out);
        row = strstr(out, "\n         8 ");
        CHECK(row && sscanf(row, " 8 %lf%% %lf%%", &cells[2], &cells[3]) == 2, "E.4 grid, row 8:\n%s", out);
        expect("eval --model runs/moe/checkpoints/step_1.safetensors --samples 64 --few-shot 0", 0, "top-1 ");
        const char *t = strstr(out, "top-1 ");
        CHECK(t && sscanf(t, "top-1 %lf", &ev) == 1 && fabs(ev - cells[3]) < 0.06,
              "E.4 with every expert kept: %.2f%%, eval's zero-shot top-1 %.1f%%", cells[3], ev);
    }
    expect("prune --model runs/moe/checkpoints/step_1.safetensors --keep-image 0 --keep-text all", 1,
           "--keep-image 0: expected up to 16 comma-separated counts in [1, 8]");
    expect("prune --model runs/moe/checkpoints/step_1.safetensors --keep-image 2 --keep-text 2 -o x.safetensors", 1,
           "leave out --modality, --keep and -o");
    expect("prune --model runs/moe/checkpoints/step_1.safetensors --keep-image 2", 1,
           "give --model, --keep-image N1,N2 and --keep-text N1,N2 together");
    // CLIP import / export / upcycle on the PyTorch fixtures of tests/ref/gen_clip.py, then training
    // on from the upcycled model
    char fx[1024], args[1536];
    CHECK(realpath(fixture_dir(), fx) != NULL, "no fixture folder %s", fixture_dir());
    snprintf(args, sizeof(args), "import %s/clip_openclip.safetensors -o clip.safetensors --image-heads 2 --text-heads 1", fx);
    expect(args, 0, "image tower: width 128, layers 2, heads 2, MLP 512, patch 8, image 32 px");
    snprintf(args, sizeof(args), "import --from hf %s/clip_hf_f16.safetensors -o hf16.safetensors --image-heads 2 --text-heads 2", fx);
    expect(args, 0, "text tower: width 64, layers 3, heads 2, MLP 256, context 16, vocabulary 100");
    // the preprocessing (and a tokenizer, which this 100-id model is too small for) go into the file
    snprintf(args, sizeof(args), "import %s/clip_openclip.safetensors -o clipn.safetensors --image-heads 2 --text-heads 1 --image-mean 0.5 0.5 0.5 "
             "--image-std 0.25", fx);
    expect(args, 0, "imported");
    expect("classify --model clipn.safetensors --image x.png --labels a,b --image-mean 0.4", 1,
           "--image-mean 0.4,0.4,0.4 contradicts the mean 0.5,0.5,0.5 records in clipn.safetensors");
    snprintf(args, sizeof(args), "import %s/clip_openclip.safetensors -o x.safetensors --image-mean 0.5", fx);
    expect(args, 1, "give --image-mean and --image-std together");
    test_write_file(test_path(dir, "m.txt"), "#version: 0.2\nz o\n", 18);
    snprintf(args, sizeof(args), "import %s/clip_openclip.safetensors -o x.safetensors --image-heads 2 --text-heads 1 --tokenizer m.txt", fx);
    expect(args, 1, "--tokenizer m.txt has 515 ids, more than the model's vocabulary of 100");
    snprintf(args, sizeof(args), "import %s/clip_openclip.safetensors -o x.safetensors", fx);
    expect(args, 1, "width 128 does not tell its attention heads: candidates 1 (head width 128), 2 (head width 64), "
           "4 (head width 32)");
    snprintf(args, sizeof(args), "import --from hf %s/clip_openclip.safetensors -o x.safetensors", fx);
    expect(args, 1, "has OpenAI/OpenCLIP names, not HF CLIPModel ones");
    expect("import corrupt.safetensors -o x.safetensors", 1, "corrupt.safetensors");
    expect("import clip.safetensors -o x.safetensors", 1, "clip.safetensors: a vlmoe model file");
    expect("import clip.safetensors", 1, "give DIR or IN.safetensors and -o OUT.safetensors");
    expect("export --model clip.safetensors --to hf -o hf.safetensors --dtype bf16", 0, "(hf names, BF16)");
    expect("export --model runs/a/checkpoints/step_4.safetensors --to openclip -o x.safetensors", 1, "one_tower");
    expect("upcycle clip.safetensors -o up.safetensors --experts 4 --top-k 2 --moe-layers every_2 --towers image,text",
           0, "text tower blocks 1: 4 experts, top-2, capacity factor 2 (eval 2)");
    expect("upcycle clip.safetensors -o x.safetensors --moe-layers 0,7", 1, "--moe-layers 0,7");
    expect("export --model up.safetensors --to hf -o x.safetensors", 1, "it has MoE layers");
    expect("upcycle up.safetensors -o x.safetensors", 1, "already has MoE layers");
    expect("train --pretrained up.safetensors --steps 2 --batch-size 8 --eval-samples 0 --logs runs --name up", 0,
           "trained to step 2");
    // --preset clipup: CLIP-UP's routing and losses, and its upcycled-phase lr and weight decay
    expect("train --pretrained up.safetensors --preset clipup --steps 2 --batch-size 8 --eval-samples 0 --logs runs "
           "--name upp", 0, "trained to step 2");
    char pj[256];
    snprintf(pj, sizeof(pj), "%s/runs/upp/params.json", dir);
    char *params = test_read_file(pj, NULL);
    CHECK(params && strstr(params, "\"lr\":\t5e-05") && strstr(params, "\"wd\":\t0.05"), "--preset clipup lr/wd: %s",
          params ? params : "no params.json");
    free(params);
    expect("train --pretrained clip.safetensors --preset clipup --steps 1 --logs runs --name d", 1, "has no MoE layers");
    // a run folder another run holds (its lock, as a second job given the same --name, or an
    // unnamed run started in the same second, finds it): refused, naming the holder, and nothing
    // of the folder is touched; once the holder is gone a fresh run goes in
    char lk[256];
    snprintf(lk, sizeof(lk), "%s/runs/busy", dir);
    CHECK(mkdir(lk, 0755) == 0, "mkdir %s", lk);
    snprintf(lk, sizeof(lk), "%s/runs/busy/.vlmoe.lock", dir);
    const int lfd = open(lk, O_RDWR | O_CREAT, 0644);
    CHECK(lfd >= 0 && flock(lfd, LOCK_EX | LOCK_NB) == 0 && write(lfd, "4242\n", 5) == 5, "hold %s", lk);
    expect("train --steps 1 --batch-size 8 --eval-samples 0 --logs runs --name busy", 1,
           "runs/busy is in use by another run (process 4242");
    snprintf(lk, sizeof(lk), "%s/runs/busy/metrics.jsonl", dir);
    CHECK(access(lk, F_OK) != 0, "a refused run wrote %s", lk);
    close(lfd);
    expect("train --steps 1 --batch-size 8 --eval-samples 0 --logs runs --name busy", 0, "trained to step 1");
    char cmd[256];
    snprintf(cmd, sizeof(cmd), "rm -rf %s", dir);
    CHECK(system(cmd) == 0, "cleanup");
    return test_summary("test_cli");
}
