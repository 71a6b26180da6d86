/* The report of `kvcal report` (internal; the API is in kvformats.h): what
 * a report holds, and the page and figures it renders.
 *
 * Page layout (one HTML5 file, UTF-8, no <script>, nothing fetched): a
 * heading and a one-line summary, then one <section> per part whose inputs
 * were given, in this order, each figure inline as <svg> and also written
 * alone as STEM-<name>.svg beside the page (STEM: the page's path less a
 * final ".html"):
 *
 *   spectra   per layer, K and V: each unit's output-covariance eigenvalues
 *             λ_i / λ_1 on a log axis (needs --stats and --model)
 *   energy    per layer, K and V: the variance explained by the first r
 *             directions, 1 − Σ_{j>r} λ_j / (Σ λ_j − N‖μ‖²) (what decompose's
 *             eps rule thresholds; the plain cumulative energy when μ = 0),
 *             the chosen rank of each unit marked (ranks need --compressed)
 *   ranks     heat map of each unit's rank over its width, layers by KV heads
 *   bytes     KV cache bytes per token per layer, base against K + V
 *             (ranks and bytes need --compressed)
 *   error     predicted against measured relative output error per unit,
 *             log-log with y = x (needs --compressed, --model, --eval-stats)
 *   quality   PPL against KV bytes kept for each --results row and --verify
 *             file, one panel per model, text and window count, the Pareto
 *             front of each panel drawn as a line
 *   provenance  text: the model and its config, the statistics files, the
 *             compressed model's manifest options, the results' protocol.
 *
 * Every number is printed with a fixed printf format and every list is in
 * input order (layers, sides, units; files and lines as given), so the same
 * inputs give the same bytes. Text from files is escaped (& < > ") and made
 * valid UTF-8 (kv_utf8_repair) with control characters dropped. */
#ifndef KV_REPORT_H
#define KV_REPORT_H

#include "kvformats.h"

/* One block of one layer's keys (which 0) or values (which 1): a unit of
 * the compressed model, or one KV head of a side that is not compressed
 * (or of every side without a compressed model). */
struct kv_report_unit {
    int64_t layer;
    int which;
    int64_t unit;           /* index among the side's units; -1 for a head block */
    int64_t head0, n_heads;
    int64_t width;          /* n_heads * head_dim */
    int mode;               /* enum kv_lr_mode; -1 without a compressed model */
    int64_t rank;           /* -1 when not compressed */
    int64_t bytes;          /* KV bytes per token (kv_lr_unit_bytes_at); -1 without */
    double predicted;       /* dropped / energy of the manifest; NaN without */
    double *eig;            /* [width] eigenvalues, descending; NULL without spectra */
    double var;             /* Σ eig − N‖μ‖² (the variance the eps rule of decompose
                               measures against; Σ eig for rotation units); NaN without */
    double resid, total;    /* measured Σ‖y − ŷ‖² and Σ‖y‖² on the evaluation statistics */
    double measured;        /* resid / total; NaN when not measured (why says why) */
    char why[160];
};

/* A statistics file as the provenance shows it. */
struct kv_report_stats {
    char *role, *path;
    struct kv_stats_info info;
    char **inputs;          /* [info.n_inputs] one line each */
};

/* One point of the quality figure. */
struct kv_report_point {
    char *group;            /* the panel: "MODEL on TEXT, W windows" */
    char *series;           /* the colour: the method ("palu"; "palu, 4-bit") */
    char *label;            /* the row ("palu uniform 0.5"), for its tooltip */
    char *source;           /* "FILE:LINE" */
    double ratio;           /* KV bytes kept, a fraction of the base */
    double ppl, base_ppl, kl;
    int verify;             /* from --verify (drawn apart) */
};

struct kv_report {
    char *title;
    /* shapes: from the model, else from the compressed model; 0 when neither */
    int64_t n_layers, n_kv_heads, head_dim;
    char *model_path;       /* NULL without a model */
    char model_desc[320];
    char fingerprint[65];
    struct kv_report_stats *stats;
    int64_t n_stats;
    /* the compressed model */
    char *comp_path;        /* NULL without one */
    char method[16], alloc[16];
    char *options_json;     /* compact JSON of the manifest's options, or NULL */
    char *source;           /* the manifest's model.source, or NULL */
    int kv_bits, hadamard;
    double eps;             /* the options' eps, NaN when not given */
    int64_t base_bytes, comp_bytes;
    int64_t *layer_bytes;   /* [n_layers][3]: base, K, V per token */
    struct kv_report_unit *units;
    int64_t n_units;
    int has_spectra;        /* eig filled */
    int has_measured;       /* measure ran (units may still be NaN) */
    char *eval_path;
    struct kv_report_point *points;
    int64_t n_points, cap_points;
    char **results_paths;   /* results files and their row counts */
    int64_t *results_rows, *results_refused;
    int64_t n_results;
    char **verify_paths;
    int64_t n_verify;
};

/* Per-KV-head units (one per head, rank -1) for every layer and side, for
 * a report without a compressed model; the shapes must be set. */
int kv_report_head_units(struct kv_report *r, struct kv_err *err);

/* Figure names in page order. */
#define KV_REPORT_N_FIGURES 6
extern const char *const kv_report_figure_names[KV_REPORT_N_FIGURES];

#endif
