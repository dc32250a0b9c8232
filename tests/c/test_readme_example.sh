#!/bin/sh
# The README's C example compiles with the command printed beside it, runs, and agrees with its
# own double-precision loops.
#   test_readme_example.sh SOURCE_DIR LIBRARY_DIR
# The README writes the command for the repository root with the library in build/. It runs here
# exactly as printed, in a scratch directory where include/ links to SOURCE_DIR/include and build/
# to LIBRARY_DIR (the directory holding libflashattn.so, whatever the build directory's name).
# The code is the ```c block between <!-- c-example:begin --> and <!-- c-example:end -->, the
# command the ```sh block between <!-- c-example-command:begin --> and <!-- c-example-command:end -->.
set -eu
src=$1
lib=$2
readme=$src/README.md
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# Prints the lines of the fenced block between the markers <!-- $1:begin --> and <!-- $1:end -->.
block() {
    awk -v begin="<!-- $1:begin -->" -v end="<!-- $1:end -->" '
        $0 == begin { on = 1; next }
        $0 == end { on = 0; next }
        on && /^```/ { next }
        on { print }' "$readme"
}

block c-example > "$work/example.c"
block c-example-command > "$work/command.sh"
if [ ! -s "$work/example.c" ] || [ ! -s "$work/command.sh" ]; then
    echo "FAIL: README.md lacks the c-example or c-example-command markers" >&2
    exit 1
fi
echo "command: $(cat "$work/command.sh")"
ln -s "$src/include" "$work/include"
ln -s "$lib" "$work/build"

# The example's numbers: "max |flashattn - naive| = X", X finite and below 1e-5.
check() {
    printf '%s\n' "$1"
    printf '%s\n' "$1" | awk '
        /^max \|flashattn - naive\| = / { x = $NF; found = 1 }
        END {
            if (!found) { print "FAIL: the example printed no difference"; exit 1 }
            if (x !~ /^[0-9.e+-]+$/ || x + 0 >= 1e-5) { print "FAIL: difference " x; exit 1 }
        }'
}

# As printed: compile, then run with the example's default seed.
out=$(cd "$work" && sh ./command.sh 2>&1) || { printf '%s\n' "$out"; echo "FAIL: the command failed"; exit 1; }
check "$out"

# A fresh seed, so the inputs differ from run to run.
seed=$(od -An -N4 -tu4 /dev/urandom | tr -d ' ')
echo "seed: $seed"
out=$(cd "$work" && ./example "$seed" 2>&1) || { printf '%s\n' "$out"; echo "FAIL: seed $seed"; exit 1; }
check "$out"

# The example stays warning-free strict C11.
(cd "$work" && cc -std=c11 -Wall -Wextra -Wpedantic -Werror -fsyntax-only -Iinclude example.c)
echo "PASS"
