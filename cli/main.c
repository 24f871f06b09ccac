// main.c: the vlmoe command: dispatches to one subcommand per file in cli/.
#include <errno.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>
#include <string.h>

#include "caption.h"
#include "cli.h"
#include "common.h"
#include "dist/dist.h"
#include "report.h"
#include "tokenize.h"
#include "vlmoe_train.h"

// The process's rank in a run on several processes (cli_set_dist), -1 alone.
static int g_rank = -1;

static void on_timeout(void *d, const char *message) {
    fprintf(stderr, "vlmoe: %s\n", message);
    vlmoe_dist_abort(d, 1);
}

void cli_set_dist(vlmoe_dist *d) {
    if (d->world < 2) return;
    g_rank = d->rank;
    vlmoe_dist_on_timeout(on_timeout, d);
}

int cli_error(const char *cmd, const char *fmt, ...) {
    // one write for the whole line: under mpirun the ranks share the terminal, and a line written
    // in pieces comes out with another rank's progress inside it
    char head[64], small[2048], *msg = small;
    if (g_rank >= 0) snprintf(head, sizeof head, "vlmoe %s: rank %d: ", cmd, g_rank);
    else snprintf(head, sizeof head, "vlmoe %s: ", cmd);
    va_list ap;
    va_start(ap, fmt);
    const int n = vsnprintf(small, sizeof small, fmt, ap);
    va_end(ap);
    if (n >= (int)sizeof small && (msg = malloc((size_t)n + 1))) {
        va_start(ap, fmt);
        vsnprintf(msg, (size_t)n + 1, fmt, ap);
        va_end(ap);
    }
    fprintf(stderr, "%s%s\n", head, msg ? msg : small);
    if (msg != small) free(msg);
    return 1;
}

static const char *USAGE =
    "vlmoe " VLMOE_VERSION ": sparse Mixture-of-Experts vision-language models (LIMoE, CLIP-UP, Soft MoE, VL-MoE)\n\n"
    "usage: vlmoe <command> [options]     (vlmoe <command> --help for its options)\n\n"
    "commands:\n"
    "  train      train a contrastive image-text model (dense or MoE)\n"
    "  eval       zero-shot, retrieval, few-shot and routing report of a checkpoint\n"
    "  classify   label probabilities of images for labels you name (zero-shot)\n"
    "  embed      image or text embeddings -> a safetensors file\n"
    "  soup       average checkpoints (uniform or greedy)\n"
    "  info       parameters, active parameters and GFLOP per pair of a model config\n"
    "  prune      drop the experts a modality uses least, for one-modality inference\n"
    "  import     a pretrained CLIP (OpenAI/OpenCLIP or HF names) -> a vlmoe model\n"
    "  export     a dense two_tower model -> OpenAI/OpenCLIP or HF CLIP names\n"
    "  upcycle    dense -> MoE: chosen MLPs become copied experts (CLIP-UP)\n"
    "  tokenize   CLIP BPE ids and pieces of a text\n"
    "  tokenizer  train a BPE vocabulary from captions (vlmoe tokenizer train)\n"
    "  vq         learn the k-means codebook of visual tokens for VL-MoE's MIM (vlmoe vq train)\n"
    "  finetune   fine-tune a VL-MoE model: image-cls, text-cls, pair-cls (VQA, NLVR2), retrieval, caption\n"
    "  caption    caption images with a VL-MoE captioner, CIDEr-D against references (--data)\n"
    "  synth      write the built-in synthetic data as image files + captions (vlmoe synth export)\n"
    "  report     the HTML report of a run (plots, routing maps), or its TensorBoard files\n"
    "  routes     one input's routing: the expert of each patch and word (--png draws it)\n"
    "  version    print the version\n";

// OpenMP threads that wait at a barrier spin by default. When another process takes one of the
// cores, the spinning thread holds its core while the thread with the work waits for a time
// slice: with one of 2 cores busy elsewhere, a 2-thread limoe-mini step took 1.55 s spinning and
// 0.087 s waiting passively. libgomp reads its settings when it is loaded, before main, so vlmoe
// runs itself once more with OMP_WAIT_POLICY=passive unless the user chose a policy.
static void wait_passively(char **argv) {
    if (getenv("OMP_WAIT_POLICY") || getenv("GOMP_SPINCOUNT")) return;
    setenv("OMP_WAIT_POLICY", "passive", 1);
    execv("/proc/self/exe", argv); // returns only on failure: go on with spinning threads
}

static int run_command(int argc, char **argv) {
    wait_passively(argv);
    // a file-size limit (ulimit -f) is met like a full disk: the write fails with EFBIG and the
    // command stops with the file named, instead of being killed mid-line by SIGXFSZ
    signal(SIGXFSZ, SIG_IGN);
    if (argc < 2 || !strcmp(argv[1], "--help") || !strcmp(argv[1], "-h") || !strcmp(argv[1], "help")) {
        fputs(USAGE, argc < 2 ? stderr : stdout);
        return argc < 2 ? 2 : 0;
    }
    char norm[4][CLI_NORM_LEN]; // "--image-mean 0.48 0.45 0.41" as "--image-mean=0.48,0.45,0.41"
    argc = cli_join_norm_flags(argc, argv, norm, 4);
    // only training runs on several processes; a launch of any other command would start W
    // copies doing the same work and writing the same files
    const int contrastive = !strcmp(argv[1], "train") && !cli_train_is_mome(argc, argv);
    const char *by = NULL;
    const long procs = vlmoe_dist_launched(&by);
    if (strcmp(argv[1], "train") && procs != 0 && procs != 1) {
        fprintf(stderr, "vlmoe %s: started by %s as one of several processes, but this command runs on one process "
                "(under mpirun only `vlmoe train` trains data-parallel): run it without the launcher\n", argv[1], by);
        return 1;
    }
    if (!strcmp(argv[1], "train")) return contrastive ? cmd_train(argc, argv) : cmd_train_mome(argc, argv);
    if (!strcmp(argv[1], "vq")) return cmd_vq(argc, argv);
    if (!strcmp(argv[1], "finetune")) return cmd_finetune(argc, argv);
    if (!strcmp(argv[1], "caption")) return cmd_caption(argc, argv);
    if (!strcmp(argv[1], "synth")) return cmd_synth(argc, argv);
    if (!strcmp(argv[1], "eval")) return cmd_eval(argc, argv);
    if (!strcmp(argv[1], "classify")) return cmd_classify(argc, argv);
    if (!strcmp(argv[1], "embed")) return cmd_embed(argc, argv);
    if (!strcmp(argv[1], "soup")) return cmd_soup(argc, argv);
    if (!strcmp(argv[1], "info")) return cmd_info(argc, argv);
    if (!strcmp(argv[1], "prune")) return cmd_prune(argc, argv);
    if (!strcmp(argv[1], "import")) return cmd_import(argc, argv);
    if (!strcmp(argv[1], "export")) return cmd_export(argc, argv);
    if (!strcmp(argv[1], "upcycle")) return cmd_upcycle(argc, argv);
    if (!strcmp(argv[1], "tokenize")) return cmd_tokenize(argc, argv);
    if (!strcmp(argv[1], "tokenizer")) return cmd_tokenizer(argc, argv);
    if (!strcmp(argv[1], "report")) return cmd_report(argc, argv);
    if (!strcmp(argv[1], "routes")) return cmd_routes(argc, argv);
    if (!strcmp(argv[1], "version") || !strcmp(argv[1], "--version")) {
        printf("vlmoe %s\n", VLMOE_VERSION);
        return 0;
    }
    fprintf(stderr, "vlmoe: unknown command '%s'\n\n%s", argv[1], USAGE);
    return 2;
}

// What a command prints (eval --json, classify, the reports) is its output too: a standard output
// that cannot be written (a full disk behind a redirection) is an error, never exit status 0.
int main(int argc, char **argv) {
    int rc = run_command(argc, argv);
    errno = 0;
    if (fflush(stdout) != 0 || ferror(stdout)) {
        fprintf(stderr, "vlmoe%s%s: cannot write the standard output: %s\n", argc > 1 ? " " : "", argc > 1 ? argv[1] : "",
                strerror(errno ? errno : EIO));
        if (!rc) rc = 1;
    }
    return rc;
}
