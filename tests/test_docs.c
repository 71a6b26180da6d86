/* The documentation's examples: every console block of README.md and of
 * the markdown files in docs/ runs and must print what the block shows
 * (tests/docs.sh has the rules and the short list of masked timings). One
 * test per file; a file with console blocks skips when the shared test data
 * is absent. Run from the repository root, as make test does; `make docs`
 * rewrites the blocks after a meant change. */
#include <glob.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "testutil.h"

/* Run tests/docs.sh with args; returns its exit status and its output
 * (stdout and stderr, malloc'd). */
static int run_docs(const char *env, const char *args, char **out) {
    char cmd[4096];
    snprintf(cmd, sizeof cmd, "%s bash tests/docs.sh %s 2>&1 </dev/null", env ? env : "", args);
    FILE *p = popen(cmd, "r");
    cr_assert_not_null(p, "popen failed: %s", cmd);
    size_t cap = 4096, n = 0;
    char *s = malloc(cap);
    for (size_t r; (r = fread(s + n, 1, cap - n - 1, p)) > 0;)
        if ((n += r) + 1 == cap) s = realloc(s, cap *= 2);
    s[n] = 0;
    int st = pclose(p);
    *out = s;
    return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + (WIFSIGNALED(st) ? WTERMSIG(st) : 0);
}

static void check_file(const char *file) {
    char args[512], *out;
    snprintf(args, sizeof args, "check %s", file);
    int rc = run_docs(NULL, args, &out);
    if (rc == 77) {
        out[strcspn(out, "\n")] = 0;
        cr_skip_test("%s", out);
    }
    cr_assert_eq(rc, 0, "tests/docs.sh check %s exited %d:\n%s", file, rc, out);
    free(out);
}

Test(docs, readme_examples_print_what_they_show) { check_file("README.md"); }
Test(docs, formats_examples_print_what_they_show) { check_file("docs/formats.md"); }
Test(docs, results_examples_print_what_they_show) { check_file("docs/results.md"); }
Test(docs, performance_examples_print_what_they_show) { check_file("docs/performance.md"); }
Test(docs, correctness_examples_print_what_they_show) { check_file("docs/correctness.md"); }
Test(docs, design_examples_print_what_they_show) { check_file("docs/design.md"); }
Test(docs, families_examples_print_what_they_show) { check_file("docs/families.md"); }
Test(docs, bench_8b_examples_print_what_they_show) { check_file("docs/bench-8b.md"); }
Test(docs, report_examples_print_what_they_show) { check_file("docs/report.md"); }

/* A new document gets its test above: every markdown file in docs/ is one of these. */
Test(docs, every_document_is_checked) {
    static const char *const checked[] = {"docs/formats.md", "docs/results.md",
                                          "docs/performance.md", "docs/correctness.md",
                                          "docs/design.md", "docs/families.md",
                                          "docs/bench-8b.md", "docs/report.md"};
    glob_t g;
    cr_assert_eq(glob("docs/*.md", 0, NULL, &g), 0, "no docs/*.md from %s", getcwd(NULL, 0));
    for (size_t i = 0; i < g.gl_pathc; i++) {
        int found = 0;
        for (size_t j = 0; j < sizeof checked / sizeof checked[0]; j++)
            found |= !strcmp(g.gl_pathv[i], checked[j]);
        cr_assert(found, "%s has no test in tests/test_docs.c", g.gl_pathv[i]);
    }
    cr_assert_eq(g.gl_pathc, sizeof checked / sizeof checked[0]);
    globfree(&g);
}

/* The checker itself, on a file of shell commands (no shared data needed):
 * a timing may change, a digit of a result may not, and the failure names
 * the file, the block, and the first differing line. */
Test(docs, a_changed_result_fails_and_a_changed_timing_does_not) {
    char *dir = kvt_temp_dir();
    char *md = kvt_path(dir, "t.md");
    FILE *f = fopen(md, "w");
    cr_assert_not_null(f);
    fputs("# t\n\n```console\n"
          "$ echo 'speed     1200 tokens/s (1 threads, 0.50 s), peak rss 30.1 MiB'\n"
          "speed     99 tokens/s (1 threads, 12.34 s), peak rss 2.0 MiB\n"
          "$ echo 'ppl       7.6905'\n"
          "ppl       7.6905\n"
          "```\n",
          f);
    fclose(f);
    char env[1024], args[1024], *out;
    snprintf(env, sizeof env, "KVCAL_SHARED='%s'", dir);
    snprintf(args, sizeof args, "check '%s'", md);
    int rc = run_docs(env, args, &out);
    cr_assert_eq(rc, 0, "a changed timing failed the check:\n%s", out);
    free(out);

    f = fopen(md, "w");
    fputs("# t\n\n```console\n$ echo 'ppl       7.6905'\nppl       7.6915\n```\n", f);
    fclose(f);
    rc = run_docs(env, args, &out);
    cr_assert_eq(rc, 1, "a changed digit passed the check (exit %d):\n%s", rc, out);
    cr_assert(strstr(out, "t.md:3: the console block starting '$ echo 'ppl       7.6905'' differs") &&
                  strstr(out, "expected: ppl       7.6915\n") && strstr(out, "actual:   ppl       7.6905\n"),
              "%s", out);
    free(out);

    f = fopen(md, "w");
    fputs("# t\n\n```\n$ kvcal inspect x\nkvcal: x: no such file or directory\n```\n", f);
    fclose(f);
    rc = run_docs(env, args, &out);
    cr_assert_eq(rc, 1, "an unchecked transcript passed (exit %d):\n%s", rc, out);
    cr_assert(strstr(out, "t.md:3: a code block without an info string"), "%s", out);
    free(out);

    remove(md);
    free(md);
    kvt_rm_dir(dir);
}
