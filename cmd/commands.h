/* Subcommand entry points: argv[0] is the subcommand name. */
#ifndef KV_COMMANDS_H
#define KV_COMMANDS_H

int cmd_verify(int argc, char **argv);
int cmd_generate(int argc, char **argv);
int cmd_tokenize(int argc, char **argv);
int cmd_inspect(int argc, char **argv);
int cmd_collect(int argc, char **argv);
int cmd_merge(int argc, char **argv);
int cmd_decompose(int argc, char **argv);
int cmd_export(int argc, char **argv);
int cmd_train(int argc, char **argv);
int cmd_train_tokenizer(int argc, char **argv);
int cmd_bench_attn(int argc, char **argv);
int cmd_report(int argc, char **argv);

#endif
