/* The perplexity of a Llama model on a text under the windows protocol,
 * computed by the naive float64 forward of tests/naive_llama.h (no BLAS, no
 * code shared with lib/forward.c): the independent reference values of
 * tests/test_ppl.c's ppl_reference suite. kvcal's tokenizer makes the ids
 * (they are checked against @huggingface/tokenizers by tests/test_tokgold.c);
 * the text starts with BOS when the tokenizer adds one.
 *
 *   cc -std=c11 -O2 -D_GNU_SOURCE -fopenmp -Ilib -Iformats -Ibuild/include -Itests \
 *      tests/ref/ppl_naive.c build/libkvcal.a -o build/ppl_naive <the LDLIBS of the Makefile>
 *   build/ppl_naive MODEL TEXT            (windows of 256, positions 1..255 scored) */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>

#include "kvformats.h"
#include "naive_llama.h"

int main(int argc, char **argv) {
    if (argc != 3) {
        fprintf(stderr, "usage: ppl_naive MODEL TEXT\n");
        return 2;
    }
    struct kv_err err;
    kv_err_clear(&err);
    struct kv_model *m;
    char *txt;
    size_t len;
    int32_t *ids;
    int64_t n;
    if (kv_model_open(argv[1], NULL, &m, &err) || kv_text_read(argv[2], &txt, &len, &err) ||
        kv_tok_encode(kv_model_tokenizer(m), txt, len, kv_tok_policy(kv_model_tokenizer(m)), &ids,
                      &n, &err)) {
        fprintf(stderr, "%s\n", err.msg);
        return 1;
    }
    const int64_t T = 256, V = kv_model_config(m)->vocab_size;
    int64_t windows = n / T;
    double nll = 0;
    for (int64_t w = 0; w < windows; w++) {
        double *lg = naive_forward(m, ids + w * T, T);
        for (int64_t t = 0; t + 1 < T; t++) {
            const double *row = lg + t * V;
            double mx = row[0], s = 0;
            for (int64_t v = 1; v < V; v++) mx = row[v] > mx ? row[v] : mx;
            for (int64_t v = 0; v < V; v++) s += exp(row[v] - mx);
            nll += mx + log(s) - row[ids[w * T + t + 1]];
        }
        free(lg);
    }
    double mean = nll / (double)(windows * (T - 1));
    printf("tokens %lld windows %lld scored %lld nll %.9f ppl %.6f\n", (long long)n,
           (long long)windows, (long long)(windows * (T - 1)), mean, exp(mean));
    free(ids), free(txt);
    kv_model_close(m);
    return 0;
}
