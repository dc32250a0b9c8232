#!/usr/bin/env python3
"""Checks the library's layering (Python 3 standard library only).

Layers, low to high: util < core (and kernels/, the headers shared with NVRTC, and mod/, the
score/mask programs core validates) < plan < cpu, cuda < api. Two kinds of arrow are read from
src/ and kernels/: a file's #include "..." lines, and its uses of a function or variable that
another file of src/ defines (a call through a declaration in a shared header is an arrow too).
An arrow may point to its own layer or a lower one (core and kernels, and core and mod, point
at each other too); cpu and cuda never point at each other. A module is a .c file with the .h
of the same name; no two modules may point at each other, directly or around a longer circle.

Usage: check_layers.py [ROOT] [--graph]. Exits 1, naming each file and arrow, on any violation;
--graph prints the module dependency graph. check_layers.py --self-test checks the checker on a
small tree with one violation of each kind.
"""
import os
import re
import sys

RANKS = {"util": 0, "core": 1, "kernels": 1, "mod": 1, "plan": 2, "cpu": 3, "cuda": 3, "api": 4}
# Layers of one rank that may point at each other (module cycles are still refused).
PEERS = ({"core", "kernels"}, {"core", "mod"})
INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)
SOURCES = (".c", ".h", ".cu", ".cuh")


def layer_of(rel):
    """The layer of a path relative to the root ("src/cpu/x.c" -> "cpu"), None if outside."""
    parts = rel.split("/")
    if parts[0] == "kernels":
        return "kernels"
    if parts[0] == "src" and len(parts) > 2 and parts[1] in RANKS:
        return parts[1]
    return None


def module_of(rel):
    return os.path.splitext(rel)[0]


def resolve(root, rel, name):
    """The file an #include "name" in rel finds, as the build's search path does: the including
    file's folder, then src/ and kernels/. None for the public header and system files."""
    for base in (os.path.dirname(rel), "src", "kernels"):
        cand = os.path.normpath(os.path.join(base, name))
        if os.path.isfile(os.path.join(root, cand)):
            return cand.replace(os.sep, "/")
    return None


def sources(root):
    """Every source file under src/ and kernels/, relative to root."""
    out = []
    for top in ("src", "kernels"):
        for folder, _, files in os.walk(os.path.join(root, top)):
            for f in files:
                if f.endswith(SOURCES):
                    out.append(os.path.relpath(os.path.join(folder, f), root).replace(os.sep, "/"))
    return sorted(out)


COMMENT_OR_STRING = re.compile(
    r'//[^\n]*|/\*.*?\*/|"(?:\\.|[^"\\\n])*"|\'(?:\\.|[^\'\\\n])*\'', re.S)
FUNC_HEAD = re.compile(r"(\w+)\s*\((?:[^()]|\([^()]*\))*\)\s*$")
VAR_HEAD = re.compile(r"(\w+)\s*(?:\[[^\]]*\]\s*)*=\s*$")
IDENT = re.compile(r"\b[A-Za-z_]\w*\b")


def code_of(text):
    """text without comments, string and character literals, and #include lines."""
    text = COMMENT_OR_STRING.sub(lambda m: " " if m.group(0)[0] == "/" else '""', text)
    return "\n".join(l for l in text.split("\n") if not re.match(r"\s*#\s*include\b", l))


def definitions(code):
    """(name, is_static) of the functions and initialised variables code defines at file scope."""
    code = re.sub(r"^\s*#.*?(?<!\\)$", " ", code, flags=re.M | re.S)
    out, depth, head = [], 0, []
    for ch in code:
        if depth == 0:
            if ch == "{":
                h = "".join(head).strip()
                m = FUNC_HEAD.search(h) or VAR_HEAD.search(h)
                if m and not h.startswith("typedef"):
                    out.append((m.group(1), bool(re.match(r"(static|extern)\b", h))))
                head = []
            elif ch in ";}":
                head = []
            else:
                head.append(ch)
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth = max(0, depth - 1)
    return out


PROTO = re.compile(r"(\w+)\s*\((?:[^()]|\([^()]*\))*\)\s*(?:FA_PRINTF\s*\([^()]*\)\s*)?$")


def references(code):
    """The identifiers code refers to, leaving out file-scope declarations (prototypes and
    extern declarations name what another file defines; only a use makes an arrow)."""
    directives = re.findall(r"^\s*#.*?(?<!\\)$", code, flags=re.M | re.S)
    code = re.sub(r"^\s*#.*?(?<!\\)$", " ", code, flags=re.M | re.S)
    kept, depth, head = [d + "\n" for d in directives], 0, []
    for ch in code:
        if depth == 0 and ch == ";":
            h = "".join(head).strip()
            if not (PROTO.search(h) or h.startswith("extern")):
                kept.append(h + ";")
            head = []
            continue
        if depth == 0 and ch in "{}":
            kept.append("".join(head))
            head = []
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth = max(0, depth - 1)
        (head if depth == 0 else kept).append(ch)
    kept.append("".join(head))
    return set(IDENT.findall("".join(kept)))


def scan(root):
    """Every arrow (file, file it points to, why) inside src/ and kernels/."""
    files = sources(root)
    code, owned, defs = {}, {}, {}
    for rel in files:
        with open(os.path.join(root, rel), encoding="utf-8", errors="replace") as fh:
            text = fh.read()
        code[rel] = (text, code_of(text))
        owned[rel] = set()
        for name, static in definitions(code[rel][1]):
            owned[rel].add(name)
            if not static and rel.endswith(".c") and rel.startswith("src/"):
                defs.setdefault(name, rel)
    arrows = set()
    for rel in files:
        text, stripped = code[rel]
        for name in INCLUDE.findall(text):
            dst = resolve(root, rel, name)
            if dst is not None and layer_of(dst) is not None:
                arrows.add((rel, dst, "includes"))
        for name in references(stripped):
            dst = defs.get(name)
            if dst and name not in owned[rel] and module_of(dst) != module_of(rel):
                arrows.add((rel, dst, f"uses {name} of"))
    return sorted(arrows)


def upward(arrows):
    errors = []
    for src, dst, why in arrows:
        a, b = layer_of(src), layer_of(dst)
        if a is None:
            errors.append(f"{src}: not in a known layer (src/{{{','.join(RANKS)}}} or kernels/)")
        elif RANKS[b] > RANKS[a]:
            errors.append(f"{src}: {why} {dst}, an upward arrow ({a} -> {b})")
        elif RANKS[b] == RANKS[a] and a != b and {a, b} not in PEERS:
            errors.append(f"{src}: {why} {dst}, a sideways arrow between backends ({a} -> {b})")
    return errors


def module_graph(arrows):
    graph = {}
    for src, dst, _ in arrows:
        a, b = module_of(src), module_of(dst)
        graph.setdefault(a, set())
        graph.setdefault(b, set())
        if a != b:
            graph[a].add(b)
    return graph


def cycles(graph):
    """Strongly connected components of more than one module (Tarjan's algorithm)."""
    index, low, on, stack, out = {}, {}, set(), [], []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def self_test():
    """The checker finds an upward include, an upward use, a sideways include and a cycle of uses
    through declarations, and passes the same tree once they are removed."""
    import tempfile

    files = {
        "src/util/fa_u.c": '#include "core/fa_c.h"\nint fa_u(void) { return 0; }\n',
        "src/core/fa_c.h": "int fa_c(void);\n",
        "src/core/fa_c.c": '#include "core/fa_c.h"\nint fa_c(void) { return fa_p(); }\n',
        "src/plan/fa_p.c": "int fa_p(void) { return fa_c(); } /* fa_cpu_x() */\n",
        "src/cpu/fa_cpu_x.c": '#include "cuda/fa_g.h"\nint fa_cpu_x(void) { return 1; }\n',
        "src/cuda/fa_g.h": "int fa_g(void);\n",
    }
    want = ["src/util/fa_u.c: includes src/core/fa_c.h, an upward arrow (util -> core)",
            "src/core/fa_c.c: uses fa_p of src/plan/fa_p.c, an upward arrow (core -> plan)",
            "src/cpu/fa_cpu_x.c: includes src/cuda/fa_g.h, a sideways arrow",
            "cycle between src/core/fa_c, src/plan/fa_p"]
    with tempfile.TemporaryDirectory() as root:
        for rel, text in files.items():
            os.makedirs(os.path.dirname(os.path.join(root, rel)), exist_ok=True)
            with open(os.path.join(root, rel), "w") as fh:
                fh.write(text)
        arrows = scan(root)
        graph = module_graph(arrows)
        found = upward(arrows) + [f"cycle between {', '.join(c)}" for c in cycles(graph)]
        missed = [w for w in want if not any(e.startswith(w) for e in found)]
        extra = [e for e in found if not any(e.startswith(w) for w in want)]
        for rel in ("src/util/fa_u.c", "src/cpu/fa_cpu_x.c"):
            os.remove(os.path.join(root, rel))
        with open(os.path.join(root, "src/core/fa_c.c"), "w") as fh:
            fh.write('#include "core/fa_c.h"\nint fa_c(void) { return 0; }\n')
        arrows = scan(root)
        clean = upward(arrows) + [str(c) for c in cycles(module_graph(arrows))]
    for m in missed:
        print(f"check_layers --self-test: missed {m!r}", file=sys.stderr)
    for e in extra + clean:
        print(f"check_layers --self-test: wrongly reported {e!r}", file=sys.stderr)
    if missed or extra or clean:
        return 1
    print(f"check_layers --self-test: found the {len(want)} planted violations, nothing else")
    return 0


def main(argv):
    if "--self-test" in argv:
        return self_test()
    args = [a for a in argv if not a.startswith("--")]
    root = os.path.abspath(args[0] if args else os.path.join(os.path.dirname(__file__), ".."))
    arrows = scan(root)
    graph = module_graph(arrows)
    if "--graph" in argv:
        for m in sorted(graph, key=lambda m: (RANKS[layer_of(m + ".h") or layer_of(m)], m)):
            deps = " ".join(sorted(graph[m]))
            print(f"{m} -> {deps}" if deps else m)
        between = sorted({(layer_of(s), layer_of(d)) for s, d, _ in arrows
                          if layer_of(s) and layer_of(s) != layer_of(d)},
                         key=lambda e: (RANKS[e[0]], e[0], RANKS[e[1]], e[1]))
        print("layers: " + ", ".join(f"{a} -> {b}" for a, b in between))
    errors = upward(arrows)
    for comp in cycles(graph):
        inner = [f"{s} {why} {d}" for s, d, why in arrows
                 if module_of(s) in comp and module_of(d) in comp and module_of(s) != module_of(d)]
        errors.append(f"cycle between {', '.join(comp)}: " + "; ".join(inner))
    for e in errors:
        print(f"check_layers: {e}", file=sys.stderr)
    if errors:
        print(f"check_layers: {len(errors)} violation(s) in {root}", file=sys.stderr)
        return 1
    print(f"check_layers: {len(arrows)} arrows between {len(graph)} modules: none upward, "
          "no cycle")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
