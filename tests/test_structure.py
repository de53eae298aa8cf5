"""The codebase's shape, held as tests so that it stays carryable (docs/architecture.md): no
source file over 500 lines, no function over 60 (C++ kernels' named hot loops up to 80), no
import circle between turnkv's modules (imports inside functions included: a lazy import that
closes a circle is still one), no run of 10 code lines written twice."""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "turnkv"
MAX_FILE_LINES = 500
MAX_FUNCTION_LINES = 60
# C++ functions may pass 60 lines only where the whole function is one kernel's hot loop, named
# here: its body shares registers and locals across the loop (the running max / sum / accumulators
# of a tile, the paired rows' accumulators), and splitting it would hand those through pointers
# in the loop that runs per key block or per weight chunk, where the bits are fixed and a helper's
# call or spill shows in decode time. Even those stop at 80.
MAX_KERNEL_LOOP_LINES = 80
KERNEL_LOOPS = {
    "block_scores": "attention: one key block's scores, exp and sums for a tile's query (pair) and G heads",
    "unit_group": "attention: a tile's walk over the key blocks, pairing queries that see the same keys",
    "dot_rows_k_pair": "GGUF matmul: the k-quants' dot products, two activation rows a 512-bit vector",
}


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def _imported(name: str, path: Path, known: set[str]) -> set[str]:
    """The turnkv modules ``name`` imports, anywhere in the file."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            targets = [base] + [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        found |= {t for t in targets if t in known and t != name}
    return found


def import_cycles() -> list[list[str]]:
    """Strongly connected groups of more than one module (Tarjan), where importing a package's
    submodule counts as importing the package's ``__init__`` only when the code names it."""
    mods = _modules()
    graph = {m: _imported(m, p, set(mods)) for m, p in mods.items()}
    index, low, stack, on, groups, counter = {}, {}, [], set(), [], [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for v in graph:
        if v not in index:
            visit(v)
    return groups


def test_no_source_file_over_500_lines():
    sources = [*ROOT.rglob("*.py"), *ROOT.rglob("*.cpp"), *ROOT.rglob("*.h"), *ROOT.rglob("*.inc")]
    long = {str(p.relative_to(ROOT.parent)): n for p in sources if (n := len(p.read_text().splitlines())) > MAX_FILE_LINES}
    assert not long, f"files over {MAX_FILE_LINES} lines: {long}"


def test_no_python_function_over_60_lines():
    long = []
    for path in ROOT.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(ROOT.parent)}:{node.name} ({n})")
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines: {long}"


def cpp_functions(text: str) -> list[tuple[str, int, int]]:
    """(name, first line, lines) of each function in C++ source ``text``, from the line that names
    it to its closing brace; lambdas and blocks inside a function are its lines."""

    def blank(m: re.Match) -> str:
        return re.sub(r"[^\n]", " ", m.group())

    text = re.sub(r'//[^\n]*|/\*.*?\*/|"(?:\\.|[^"\\\n])*"|\'(?:\\.|[^\'\\\n])*\'', blank, text, flags=re.S)
    text = re.sub(r"^[ \t]*#(?:[^\n]*\\\n)*[^\n]*", blank, text, flags=re.M)   # preprocessor lines
    found, stack, start = [], [], 0
    for m in re.finditer(r"[{};]", text):
        if m.group() == "{":
            head = text[start:m.start()]
            call = re.search(r"(~?\w+)\s*\(", head)
            is_fn = (not any(stack) and call is not None and not re.match(r"\s*(if|for|while|switch)\b", head)
                     and re.search(r"\)\s*(const\s*)?(noexcept\s*)?(->[^()]*)?$", head))
            stack.append((call.group(1), text.count("\n", 0, start + call.start(1)) + 1) if is_fn else None)
        elif m.group() == "}" and stack and (fn := stack.pop()):
            found.append((fn[0], fn[1], text.count("\n", 0, m.start()) + 2 - fn[1]))
        start = m.end()
    return found


def test_no_cpp_function_over_60_lines_but_named_kernel_loops():
    long = []
    for path in sorted(ROOT.rglob("*")):
        if path.suffix in (".cpp", ".h", ".inc"):
            for name, line, n in cpp_functions(path.read_text()):
                limit = MAX_KERNEL_LOOP_LINES if name in KERNEL_LOOPS else MAX_FUNCTION_LINES
                if n > limit:
                    long.append(f"{path.relative_to(ROOT.parent)}:{line} {name} ({n})")
    assert not long, f"C++ functions over their limit: {long}"


def test_the_cpp_function_finder_measures_a_function():
    """The check above can fail: a function is found, named and measured from its name's line to
    its closing brace, and a struct, a namespace, a lambda inside it and a comment are not functions."""
    src = """namespace a {
struct S { int x; };
// int fake(int y) {
template <int N>
static inline int f(int a,
                    int b) {
    auto g = [&](int c) { return c; };
    if (a) { return g(b); }
    return "}" [0];
}
}  // namespace a
"""
    assert cpp_functions(src) == [("f", 5, 6)]


MIN_REPEATED_RUN = 10
_THIN = re.compile(r"[\[\](){};,:]*|(from\s+\S+\s+)?import\s.*|#.*|//.*")


def code_lines(text: str) -> list[tuple[int, str]]:
    """(line number, text with its white space folded) of each line that carries code: blank lines,
    comments, preprocessor and import lines and lone punctuation left out, as a reader skims them."""
    folded = ((n, " ".join(line.split())) for n, line in enumerate(text.splitlines(), 1))
    return [(n, line) for n, line in folded if not _THIN.fullmatch(line)]


def repeated_runs(files: dict[str, str], run: int = MIN_REPEATED_RUN) -> list[str]:
    """Places where ``run`` code lines in a row stand again, the same to the letter, elsewhere (in
    another file, or in the same file without overlapping): one entry a repeated place."""
    first, found = {}, []
    for name, text in files.items():
        lines = code_lines(text)
        for i in range(len(lines) - run + 1):
            key = tuple(line for _, line in lines[i:i + run])
            start, end = lines[i][0], lines[i + run - 1][0]
            seen = first.setdefault(key, (name, start, end))
            if seen[0] != name or seen[2] < start:
                found.append(f"{name}:{start}-{end} ~ {seen[0]}:{seen[1]}-{seen[2]}")
    return found


def test_no_run_of_10_code_lines_repeats():
    """Logic written twice drifts apart: a run of 10 code lines stands once in turnkv/ (the same
    shape with other names is left to review, where it is often a table or a field list)."""
    sources = sorted(p for p in ROOT.rglob("*") if p.suffix in (".py", ".cpp", ".h", ".inc"))
    found = repeated_runs({str(p.relative_to(ROOT.parent)): p.read_text() for p in sources})
    assert not found, f"runs of {MIN_REPEATED_RUN}+ code lines written twice: {found}"


def test_the_run_finder_finds_a_repeat():
    """The check above can fail: the same 10 lines in two files, indentation and comment lines
    aside, are found; 9 are not, nor is a run that only overlaps itself."""
    body = [f"x{i} = f({i})" for i in range(10)]
    a = "import os\n" + "\n".join(body) + "\n"
    b = "def g():\n    # why\n" + "\n".join("    " + line for line in body) + "\n"
    assert repeated_runs({"a.py": a, "b.py": b}) == ["b.py:3-12 ~ a.py:2-11"]
    assert repeated_runs({"a.py": a, "b.py": b}, run=11) == []
    assert repeated_runs({"a.py": "\n".join(body[:9]), "b.py": "\n".join(body[:9])}) == []
    assert repeated_runs({"c.py": "y = 1\n" * 12}) == []


def test_no_import_circles():
    assert import_cycles() == []


def test_the_cycle_finder_finds_a_circle(tmp_path, monkeypatch):
    """The check above can fail: two modules that import each other (one lazily) are a circle."""
    pkg = tmp_path / "turnkv"
    (pkg / "a").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "a" / "__init__.py").write_text("")
    (pkg / "a" / "x.py").write_text("from . import y\n")
    (pkg / "a" / "y.py").write_text("def f():\n    from .x import g\n")
    (pkg / "b.py").write_text("from .a import x\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", pkg)
    assert import_cycles() == [["turnkv.a.x", "turnkv.a.y"]]
