"""The package's layout: every module imports on its own, no import cycle, small documented rooms."""

import ast
import functools
import re
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "attnprobe"
MODULES = sorted(
    ".".join(("attnprobe", *path.relative_to(PACKAGE).with_suffix("").parts)).removesuffix(".__init__")
    for path in PACKAGE.rglob("*.py")
)
MAX_LINES = 400


def _module_path(name: str) -> Path:
    parts = name.split(".")[1:]
    candidate = PACKAGE.joinpath(*parts)
    return candidate / "__init__.py" if candidate.is_dir() else candidate.with_suffix(".py")


@functools.cache
def _tree(path: Path) -> ast.Module:
    """The module's syntax tree, parsed once for all the layout tests of a process."""
    return ast.parse(path.read_text())


@functools.cache
def _imports(name: str) -> frozenset[str]:
    """The attnprobe modules `name` imports (at any depth of its code), resolved to module names."""
    path = _module_path(name)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(_tree(path)):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")
            if node.level:
                base = base[: len(base) - node.level + 1]
                stem = ".".join(base + ([node.module] if node.module else []))
            else:
                stem = node.module
            # `from . import x` / `from .pkg import mod` name modules; otherwise the stem itself
            targets = [
                f"{stem}.{alias.name}" if f"{stem}.{alias.name}" in MODULES else stem for alias in node.names
            ]
        else:
            continue
        found |= {t for t in targets if t in MODULES and t != name}
    return frozenset(found)


# One interpreter loads the third-party libraries once (by importing attnprobe, then forgetting every
# attnprobe module), then forks a child per module: each child starts with no attnprobe module
# loaded and imports only its one module (a cold start costs 10 s of torch and transformers).
FORK_EACH = """
import importlib, os, sys, traceback
import attnprobe
attnprobe._load()  # the public names load lazily: torch, transformers, ... once, in the parent
for loaded in [m for m in sys.modules if m == "attnprobe" or m.startswith("attnprobe.")]:
    del sys.modules[loaded]
failed, running = [], {}
def reap():
    pid, status = os.wait()
    if status != 0:
        failed.append(running[pid])
    del running[pid]
for name in sys.argv[1:]:
    if len(running) >= (os.cpu_count() or 1):  # a child per core at a time
        reap()
    pid = os.fork()
    if pid == 0:
        try:
            importlib.import_module(name)
        except BaseException:
            traceback.print_exc()
            os._exit(1)
        os._exit(0)
    running[pid] = name
while running:
    reap()
print("failed:", " ".join(sorted(failed)))
"""


@pytest.mark.thorough
def test_every_module_imports_on_its_own():
    # a module that cannot import rides along: the check can fail (one interpreter, not two cold starts)
    result = subprocess.run(
        [sys.executable, "-c", FORK_EACH, *MODULES, "attnprobe.no_such_module"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.stdout.strip() == "failed: attnprobe.no_such_module", result.stdout + result.stderr[-3000:]


def _with_packages(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """Importing attnprobe.a.b first runs attnprobe.a (its __init__): an edge to a module is also an
    edge to every package above it (the root package, which imports the public face, aside)."""
    out = {}
    for name, targets in graph.items():
        expanded = set(targets)
        for target in targets:
            parts = target.split(".")
            expanded |= {".".join(parts[:k]) for k in range(2, len(parts))}
        out[name] = {t for t in expanded if t != name and not name.startswith(t + ".")}
    return out


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """An import cycle of `graph` (module -> modules it imports), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: finished

    def visit(node, path):
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := visit(nxt, path + [nxt])):
                return cycle
        state[node] = 2
        return None

    for name in sorted(graph):
        if name not in state and (cycle := visit(name, [name])):
            return cycle
    return None


def test_no_import_cycle_between_modules_or_packages():
    graph = {name: _imports(name) for name in MODULES}
    assert graph["attnprobe.run"] >= {
        "attnprobe.run.plan",
        "attnprobe.run.files.layout",
    }  # the parser sees edges
    cycle = find_cycle(_with_packages(graph))
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_cycle_check_sees_a_planted_package_cycle():
    """suite.x imports measures.y and measures.z imports suite.w: no module cycle, but importing
    either package runs the other's __init__ half-way (the cycle the round-2 check missed)."""
    planted = {
        "attnprobe.suite": {"attnprobe.suite.x"},
        "attnprobe.suite.x": {"attnprobe.measures.y"},
        "attnprobe.measures": {"attnprobe.measures.z"},
        "attnprobe.measures.y": set(),
        "attnprobe.measures.z": {"attnprobe.suite.w"},
        "attnprobe.suite.w": set(),
    }
    assert find_cycle(planted) is None  # module by module, no cycle
    assert find_cycle(_with_packages(planted)) is not None


def test_rooms_are_small_and_say_what_they_own():
    for name in MODULES:
        path = _module_path(name)
        text = path.read_text()
        assert len(text.splitlines()) <= MAX_LINES, (
            f"{path} has {len(text.splitlines())} lines (at most {MAX_LINES})"
        )
        assert ast.get_docstring(_tree(path)), f"{path} opens without a docstring saying what it owns"


def test_downstream_rooms_do_not_reach_upstream():
    """Data flows suite -> run -> stats -> report: stats imports only itself, the analysis declaration,
    the head vocabulary (HeadSet) and the errors (no run, report, suite or model code); the run reads
    no statistics or report; no module imports the package face for its version."""
    graph = {name: _imports(name) for name in MODULES}
    allowed = {"attnprobe.schema.analysis", "attnprobe.errors", "attnprobe.heads"}
    for name in (m for m in MODULES if m.startswith("attnprobe.stats")):
        assert not {m for m in graph[name] if not m.startswith("attnprobe.stats") and m not in allowed}, name
    assert not graph["attnprobe.schema.analysis"]  # plain data, read by suite, run, stats and report
    for name in MODULES:
        if name.startswith("attnprobe.run"):
            assert not any(
                m.startswith(("attnprobe.report", "attnprobe.stats", "attnprobe.notebook.api"))
                for m in graph[name]
            ), name
        if name != "attnprobe":
            assert "attnprobe" not in graph[name], f"{name} imports the package face"


# The intended layer order, lowest first: a module imports only from its own room or rooms below it.
# Shared vocabulary (errors, defaults, heads, store) at the bottom; statistics need only the
# analysis declaration; models are loaded, then run forward (capture, packing), verified and
# intervened on; measures declare and compute, suites are parsed with them, runs execute them; the
# edits reopen runs; the report, the notebook and the command line sit on top.
LAYERS = [
    "errors", "defaults", "version", "registry", "heads", "progress", "store", "schema", "stats", "plotting",
    "attention", "model", "forward", "verify", "intervene", "measures", "suite", "run", "analyses", "edits",
    "testing", "report", "notebook", "cli", "__main__",
]  # fmt: skip


def upward_imports(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    """(importer, imported) pairs where a room imports from a room above it in LAYERS."""
    rank = {room: i for i, room in enumerate(LAYERS)}
    room = lambda module: module.split(".")[1] if module.count(".") else None
    return sorted(
        (name, target)
        for name, targets in graph.items()
        for target in targets
        if room(name) and room(target) and rank[room(target)] > rank[room(name)]
    )


def test_rooms_import_only_from_rooms_below():
    graph = {name: _imports(name) for name in MODULES}
    assert {
        room for room in (m.split(".")[1] for m in MODULES if m.count(".")) if room not in LAYERS
    } == set()
    assert upward_imports(graph) == []
    planted = {"attnprobe.stats.x": {"attnprobe.run.y"}, "attnprobe.run.y": set()}  # the check can fail
    assert upward_imports(planted) == [("attnprobe.stats.x", "attnprobe.run.y")]


def test_edits_use_the_intervention_library_not_a_measure_or_the_report():
    """The edits import a measure's package face at most (not its modules) and nothing of the report."""
    for name in (m for m in MODULES if m.startswith("attnprobe.edits")):
        for target in _imports(name):
            assert not target.startswith("attnprobe.report"), (name, target)
            assert target.count(".") <= 2 or not target.startswith("attnprobe.measures"), (name, target)


MAX_PER_FOLDER = 8


def test_at_most_eight_modules_in_a_folder():
    for folder in [PACKAGE, *(p for p in PACKAGE.rglob("*") if p.is_dir() and p.name != "__pycache__")]:
        n = len(list(folder.glob("*.py")))
        limit = MAX_PER_FOLDER if folder != PACKAGE else MAX_TOP_LEVEL
        assert n <= limit, f"{folder} holds {n} modules (at most {limit}): group them by role"


MAX_FUNCTION_LINES = 60


def test_functions_are_short():
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(_tree(path)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                assert n <= MAX_FUNCTION_LINES, (
                    f"{path}:{node.lineno} {node.name} has {n} lines (at most {MAX_FUNCTION_LINES})"
                )


MAX_PARAMETERS = 7  # a function taking more wants an object (issue 66)
# the only ones over it: signatures torch and transformers fix (the attention interface
# transformers calls, the from-scratch references mirroring torch's scaled_dot_product_attention
# and multi-head attention)
FIXED_SIGNATURES = {
    "attention/capture.py:attnprobe_attention",
    "verify/reference.py:scaled_dot_product_attention",
    "verify/reference.py:multi_head_attention",
}


def test_no_new_function_takes_more_than_seven_parameters():
    """Outside cli/ (click fixes a command's parameters); self and cls not counted; the signatures
    others fix excepted."""
    over = set()
    for path in PACKAGE.rglob("*.py"):
        if "cli" in path.relative_to(PACKAGE).parts:
            continue
        for node in ast.walk(_tree(path)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                a = node.args
                named = [x.arg for x in (*a.posonlyargs, *a.args, *a.kwonlyargs, a.vararg, a.kwarg) if x]
                if len([n for n in named if n not in ("self", "cls")]) > MAX_PARAMETERS:
                    over.add(f"{path.relative_to(PACKAGE).as_posix()}:{node.name}")
    assert over - FIXED_SIGNATURES == set(), "give these an object instead of a parameter list"
    assert FIXED_SIGNATURES - over == set(), "these no longer take more than 7: strike them off the list"


def test_allowed_keys_come_from_the_table():
    """Every key check reads a declared table (schema.keys, a measure's KEYS), none a literal list."""
    literal = (ast.List, ast.Set, ast.Tuple)
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(_tree(path)):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "check_keys":
                allowed = node.args[1]
                allowed = allowed.args[0] if isinstance(allowed, ast.Call) else allowed  # sorted(...)
                assert not isinstance(allowed, literal), f"{path}:{node.lineno} lists its keys by hand"
            if (
                isinstance(node, ast.BinOp)
                and isinstance(node.op, ast.Sub)
                and isinstance(node.right, ast.Set)
            ):
                assert "set(node)" not in ast.unparse(node.left), (
                    f"{path}:{node.lineno} lists its keys by hand"
                )


MANIFEST_READERS = {"run/files/manifest.py"}  # where manifest.json's keys are named (issue 51: at most 3)


def manifest_key_reads(tree: ast.AST) -> list[int]:
    """Lines reading a manifest by string key: `X[...]` or `X.get(...)` where X is named manifest (a
    variable, an attribute) or is the object json.loads returns for a manifest.json path."""
    named = lambda node: (
        (isinstance(node, ast.Name) and node.id == "manifest")
        or (isinstance(node, ast.Attribute) and node.attr == "manifest")
    )
    loaded = lambda node: "manifest.json" in ast.unparse(node) and "json.loads" in ast.unparse(node)
    found = []
    for node in ast.walk(tree):
        target = None
        if isinstance(node, ast.Subscript):
            target = node.value
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get":
            target = node.func.value
        if target is not None and (named(target) or (isinstance(target, ast.Call) and loaded(target))):
            found.append(node.lineno)
    return found


def test_the_manifest_is_read_by_its_fields():
    """Readers use the typed fields of run.files.manifest.Manifest (a measure's own through `entry`)."""
    readers = {
        str(path.relative_to(PACKAGE)) for path in PACKAGE.rglob("*.py") if manifest_key_reads(_tree(path))
    }
    assert readers <= MANIFEST_READERS and len(MANIFEST_READERS) <= 3, sorted(readers - MANIFEST_READERS)
    planted = "a = run.manifest['model']\nb = manifest.get('x')\n"
    planted += "c = json.loads((d / 'manifest.json').read_text())['s']"
    assert manifest_key_reads(ast.parse(planted)) == [1, 2, 3]  # the check can fail


def entry_reads(tree: ast.AST) -> list[int]:
    """Lines that read a measure's manifest entry by key: `x.entry("name", ...)` with a literal."""
    return [
        node.lineno
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and getattr(node.func, "attr", None) == "entry"
        and node.args
        and isinstance(node.args[0], ast.Constant)
        and isinstance(node.args[0].value, str)
    ]


def test_a_measure_entry_is_read_by_key_only_by_its_measure_and_its_statistics():
    """Issue 66: other rooms read a measure's record through the fields its measure gives them
    (measures.head_effects.EffectsRecord, measures.referent_choice.question_of), not by key."""
    owners = ("measures/", "stats/kinds/")
    readers = sorted(
        str(path.relative_to(PACKAGE))
        for path in PACKAGE.rglob("*.py")
        if entry_reads(_tree(path)) and not str(path.relative_to(PACKAGE)).startswith(owners)
    )
    assert readers == [], readers
    assert entry_reads(ast.parse("a = m.entry('head_effects', {})\nb = m.entry(name)")) == [1]  # can fail


# Modules that share a name by design: each measure's statistics (stats/<kind>.py beside
# measures/<kind>.py) and a command's options (run/, cli/, edits/sweep/).
SHARED_NAMES = {"attention", "likelihood", "multiple_choice", "next_token", "options"}


def test_one_name_one_place():
    """No two modules share a name, but the measure/statistics pairs and the options: a twin makes a
    reader guess which one is meant."""
    names = [path.stem for path in PACKAGE.rglob("*.py") if path.stem != "__init__"]
    twins = {name for name in names if names.count(name) > 1} - SHARED_NAMES
    assert not twins, f"modules sharing a name: {sorted(twins)}"


def test_every_error_class_lives_in_errors():
    for name in MODULES:
        if name == "attnprobe.errors":
            continue
        tree = _tree(_module_path(name))
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                assert not node.name.endswith("Error"), (
                    f"{name} defines {node.name}; error classes live in errors.py"
                )


# modules directly under attnprobe/ (the shared vocabulary: errors, defaults, version, the neutral
# registry, heads, progress, store; the package face and __main__); everything else lives in a folder
MAX_TOP_LEVEL = 9


def test_few_modules_at_the_top():
    top = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(top) <= MAX_TOP_LEVEL, f"{len(top)} modules directly under attnprobe/: {top}"


def _code_strings_and_names(path: Path) -> list[tuple[int, str]]:
    """Every identifier and string constant of a module's code, docstrings and comments aside."""
    tree = _tree(path)
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            found.append((node.lineno, node.value))
        elif isinstance(node, ast.Name):
            found.append((node.lineno, node.id))
        elif isinstance(node, ast.Attribute):
            found.append((node.lineno, node.attr))
        elif isinstance(node, (ast.FunctionDef, ast.ClassDef, ast.arg, ast.keyword)):
            found.append((node.lineno, getattr(node, "name", None) or getattr(node, "arg", None) or ""))
    return found


def _measure_words() -> set[str]:
    """Every name a registered measure owns: its key, tables, files, chunk prefixes, run attributes."""
    from attnprobe.measures import MEASURES

    words = set()
    for kind in MEASURES.values():
        words |= {kind.NAME, *kind.TABLES, *kind.READS, *(p.strip("-") for p in kind.CHUNKS if p)}
        words |= {name.split(".")[0] for name in kind.ARTEFACTS}
    return words


def test_the_run_names_no_measure():
    """run/ loops over the registry: no measure's key, table, file or chunk prefix in its code."""
    words = _measure_words()
    pattern = re.compile(
        rf"(?<![\w-])({'|'.join(map(re.escape, sorted(words, key=len, reverse=True)))})(?![\w-])"
    )
    for path in sorted((PACKAGE / "run").glob("*.py")):
        for line, text in _code_strings_and_names(path):
            assert not pattern.search(text), f"{path}:{line} names a measure: {text!r}"
    assert pattern.search("head_effects") and pattern.search("x.attention.parquet")  # the check can fail


def test_nothing_gender_specific_in_code():
    """Pronouns and gender labels come from a suite's data (its slots, control block, sentences),
    never from attnprobe's code: no 'she', 'he', 'female' or 'male' literal outside docstrings."""
    gendered = re.compile(r"\b(she|he|her|him|his|female|male)\b", re.IGNORECASE)
    for path in sorted(PACKAGE.rglob("*.py")):
        for line, text in _code_strings_and_names(path):
            assert not gendered.search(text), f"{path}:{line}: {text!r}"


def test_head_names_are_formatted_in_one_place():
    """'L26H2' is written by HeadSet alone."""
    literal = re.compile(r"L\{[^}]*\}H\{")
    for path in sorted(PACKAGE.rglob("*.py")):
        if path != PACKAGE / "heads.py":
            assert not literal.search(path.read_text()), f"{path} formats a head name itself; use HeadSet"


def test_each_measure_lays_out_its_own_report_section():
    """The report page renders Measure.section of every kind in the registry's order: neither its
    template nor report/context.py names a kind or its tables, but the two tables the run's key
    findings read, and the page's own attention view ("attention", its "examples")."""
    words = _measure_words() - {"head_stats", "behavior", "attention", "examples"}
    pattern = re.compile(
        rf"(?<![\w-])({'|'.join(map(re.escape, sorted(words, key=len, reverse=True)))})(?![\w-])"
    )
    for line, text in _code_strings_and_names(PACKAGE / "report" / "context.py"):
        assert not pattern.search(text), f"report/context.py:{line} names a measure: {text!r}"
    page = (PACKAGE / "report" / "report.html.j2").read_text()
    for tag in re.findall(r"\{[{%].*?[}%]\}", page, re.S):  # what the page reads, not its prose
        assert not pattern.search(tag), f"report.html.j2 names a measure: {tag!r}"
    assert pattern.search("{% if run.effects %}") and pattern.search("referent_accuracy")  # it can fail
