/* kvcal: the command table and dispatch. */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"
#include "commands.h"

static const struct {
    const char *name;
    int (*fn)(int, char **);
    const char *summary;
} commands[] = {
    {"verify", cmd_verify, "perplexity of a model on held-out text (windows protocol)"},
    {"tokenize", cmd_tokenize, "the token ids and pieces of a text, to compare tokenizers"},
    {"generate", cmd_generate, "greedy decoding from a prompt, for eyeballing a model"},
    {"collect", cmd_collect, "float64 calibration statistics of a model into a .kvstats file"},
    {"merge", cmd_merge, "add .kvstats shards of the same model into one file"},
    {"decompose", cmd_decompose, "low-rank K/V factors under a budget, written as a latent-cache model"},
    {"export", cmd_export, "a compressed model as a dense one (a quality proxy), or a model as MLA GGUF"},
    {"inspect", cmd_inspect, "a model, a .kvstats file's spectra, or a compressed model's ranks"},
    {"report", cmd_report, "an HTML page with SVG figures of a calibration, a compression and results"},
    {"train", cmd_train, "a small model from scratch (maintainers: the fixture models)"},
    {"train-tokenizer", cmd_train_tokenizer, "learn a byte-level BPE tokenizer.json from text"},
    {"bench-attn", cmd_bench_attn, "time one decode-attention step over a latent KV cache (runtime benchmark)"},
};
#define N_COMMANDS (int)(sizeof commands / sizeof commands[0])

static void list_commands(FILE *f) {
    fprintf(f, "usage: kvcal <command> [options]\n\n"
               "kvcal shrinks the KV cache of pretrained transformer LLMs without retraining.\n\n"
               "commands:\n");
    for (int i = 0; i < N_COMMANDS; i++)
        fprintf(f, "  %-10s %s\n", commands[i].name, commands[i].summary);
    fprintf(f, "\n'kvcal <command> --help' describes a command's options.\n"
               "models: an HF Llama directory, a GGUF file (F32/F16/BF16) or a llama2.c .bin.\n");
}

static int edit_distance(const char *a, const char *b) {
    int la = (int)strlen(a), lb = (int)strlen(b);
    if (la > 31 || lb > 31) return 99;
    int d[32][32];
    for (int i = 0; i <= la; i++) d[i][0] = i;
    for (int j = 0; j <= lb; j++) d[0][j] = j;
    for (int i = 1; i <= la; i++)
        for (int j = 1; j <= lb; j++) {
            int c = d[i - 1][j - 1] + (a[i - 1] != b[j - 1]);
            if (d[i - 1][j] + 1 < c) c = d[i - 1][j] + 1;
            if (d[i][j - 1] + 1 < c) c = d[i][j - 1] + 1;
            d[i][j] = c;
        }
    return d[la][lb];
}

static int run(int argc, char **argv) {
    /* past a file-size limit (ulimit -f) a write then fails with EFBIG,
     * which every writer reports and cleans up after, instead of the
     * process dying silently with its temporary left behind */
    signal(SIGXFSZ, SIG_IGN);
    /* KVCAL_STREAM_WEIGHTS=1 keeps every model's weights in their stored
     * dtype, converted a layer at a time; 0 converts all at load; unset,
     * models past 2 GiB of float32 weights stream (kv_model_streaming) */
    const char *sw = getenv("KVCAL_STREAM_WEIGHTS");
    if (sw && *sw) kv_model_streaming(!strcmp(sw, "0") ? -1 : 1);
    if (argc < 2) {
        list_commands(stdout);
        return EXIT_OK;
    }
    const char *name = argv[1];
    if (!strcmp(name, "-h") || !strcmp(name, "--help") || !strcmp(name, "help")) {
        if (argc > 2 && strcmp(name, "help") == 0) {
            for (int i = 0; i < N_COMMANDS; i++)
                if (!strcmp(argv[2], commands[i].name)) {
                    char *av[] = {argv[2], "--help", NULL};
                    return commands[i].fn(2, av);
                }
        }
        list_commands(stdout);
        return EXIT_OK;
    }
    if (!strcmp(name, "--version") || !strcmp(name, "version")) {
        printf("kvcal %s\n", KVCAL_VERSION);
        return EXIT_OK;
    }
    /* under mpirun -n N > 1, only collect and verify know how to share
     * their work; any other command would run N times over one output */
    int known = 0;
    for (int i = 0; i < N_COMMANDS; i++) known |= !strcmp(name, commands[i].name);
    if (known && cli_mpi_size() > 1 && strcmp(name, "collect") && strcmp(name, "verify")) {
        if (cli_mpi_rank() == 0)
            fprintf(stderr, "kvcal: %s runs in one process; under mpirun only collect and verify "
                            "spread their work (run 'kvcal %s' without mpirun)\n", name, name);
        return EXIT_USAGE;
    }
    for (int i = 0; i < N_COMMANDS; i++)
        if (!strcmp(name, commands[i].name)) return commands[i].fn(argc - 1, argv + 1);
    int best = -1, bd = 99;
    for (int i = 0; i < N_COMMANDS; i++) {
        int dd = edit_distance(name, commands[i].name);
        if (dd < bd) bd = dd, best = i;
    }
    if (best >= 0 && bd <= 3)
        fprintf(stderr, "kvcal: unknown command '%s'; did you mean '%s'?\n", name,
                commands[best].name);
    else
        fprintf(stderr, "kvcal: unknown command '%s'; run 'kvcal help' for the list\n", name);
    return EXIT_USAGE;
}

int main(int argc, char **argv) {
    cli_mpi_init(&argc, &argv);
    int rc = run(argc, argv);
    cli_mpi_finalize();
    return rc;
}
