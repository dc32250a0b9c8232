/* `flashattn precompile`: fill the kernel cache for a matrix of configurations (no GPU needed). */
#ifndef FA_PRECOMPILE_H
#define FA_PRECOMPILE_H

/* argv holds the words after "precompile". Returns the command's exit status. */
int fa_precompile_main(int argc, char **argv);

#endif /* FA_PRECOMPILE_H */
