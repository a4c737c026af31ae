"""Nothing in the repository may read outside it (a clone must work with no sibling folders).

Scans every tracked code file (package, test helpers, tests, benchmarks, scripts, CI, Docker):
- no absolute path into this workplace (`/work`, `/mnt`) and no `shared/` folder reference;
- Python: every path derived from `__file__` (`Path(__file__).parent...`, `.parents[i]`, `/ ".."`,
  `os.path.dirname(__file__)`, `os.path.join(..., "..")`, and names bound to such paths) is
  resolved symbolically and must stay inside the repository root;
- shell: `$(dirname "$0")/..` chains must stay inside the root as well.
The checker itself is tested on small snippets, so that a blind checker fails too.
"""

from __future__ import annotations

import ast
import re
import subprocess
from pathlib import Path, PurePosixPath

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCANNED_DIRS = ("vllm_subspec", "subspec_testing", "tests", "benchmarks", "scripts", ".ci")
SCANNED_ROOT_FILES = ("Dockerfile", "pyproject.toml")
CODE_SUFFIXES = (".py", ".sh", ".toml", ".cfg", ".yml", ".yaml", "")

# `/work/...`, `/mnt/...` as a path (not e.g. "framework/"); a `shared/` folder as a path component
FORBIDDEN_TEXT = [
    (re.compile(r"(?<![\w.-])/(?:work|mnt)(?:/|\b)"), "absolute path into the workplace"),
    (re.compile(r"(?:\.\./|/|[\"'`=])shared/"), "reference to a `shared/` folder"),
]


class Escape(Exception):
    pass


def _tracked_files() -> list[Path]:
    try:
        out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"],
                             cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
        files = [ROOT / f for f in out]
    except (OSError, subprocess.CalledProcessError):  # not a git checkout: walk the tree
        files = [p for p in ROOT.rglob("*") if p.is_file()]
    picked = []
    for p in files:
        rel = p.relative_to(ROOT)
        if not p.is_file() or "__pycache__" in rel.parts:
            continue
        if rel.parts[0] in SCANNED_DIRS or str(rel) in SCANNED_ROOT_FILES:
            if p.suffix in CODE_SUFFIXES:
                picked.append(p)
    return picked


class _PathResolver(ast.NodeVisitor):
    """Resolves file-anchored path expressions to parts relative to the repository root."""

    def __init__(self, rel: PurePosixPath):
        self.file_parts = list(rel.parts)
        self.names: dict[str, list[str]] = {}
        self.problems: list[str] = []

    def _up(self, parts, n, node):
        if n > len(parts):
            raise Escape(f"line {node.lineno}: goes {n - len(parts)} level(s) above the repo")
        return parts[: len(parts) - n]

    def _join(self, parts, text, node):
        for piece in str(text).split("/"):
            if piece in ("", "."):
                continue
            parts = self._up(parts, 1, node) if piece == ".." else parts + [piece]
        return parts

    def resolve(self, node):  # -> list[str] | None (None: not anchored at __file__)
        if isinstance(node, ast.Name):
            if node.id == "__file__":
                return list(self.file_parts)
            return self.names.get(node.id)
        if isinstance(node, ast.Call):
            f = node.func
            name = ast.unparse(f)
            args = [self.resolve(a) for a in node.args]
            if name in ("Path", "pathlib.Path", "PurePath", "os.path.abspath",
                        "os.path.realpath", "str", "os.fspath") and node.args:
                base = args[0]
                if base is None:
                    return None
                for extra in node.args[1:]:
                    if isinstance(extra, ast.Constant):
                        base = self._join(base, extra.value, node)
                return base
            if name == "os.path.dirname" and args and args[0] is not None:
                return self._up(args[0], 1, node)
            if name == "os.path.join" and args and args[0] is not None:
                base = args[0]
                for extra in node.args[1:]:
                    if isinstance(extra, ast.Constant):
                        base = self._join(base, extra.value, node)
                return base
            if isinstance(f, ast.Attribute) and f.attr in ("resolve", "absolute"):
                return self.resolve(f.value)
            if isinstance(f, ast.Attribute) and f.attr == "joinpath":
                base = self.resolve(f.value)
                if base is not None:
                    for extra in node.args:
                        if isinstance(extra, ast.Constant):
                            base = self._join(base, extra.value, node)
                return base
            return None
        if isinstance(node, ast.Attribute) and node.attr == "parent":
            base = self.resolve(node.value)
            return None if base is None else self._up(base, 1, node)
        if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Attribute) \
                and node.value.attr == "parents" and isinstance(node.slice, ast.Constant):
            base = self.resolve(node.value.value)
            return None if base is None else self._up(base, node.slice.value + 1, node)
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
            base = self.resolve(node.left)
            if base is not None and isinstance(node.right, ast.Constant):
                return self._join(base, node.right.value, node)
            return base
        return None

    def check(self, tree: ast.AST) -> list[str]:
        for node in ast.walk(tree):  # bind names first (module-level constants such as ROOT)
            if isinstance(node, ast.Assign) and len(node.targets) == 1 \
                    and isinstance(node.targets[0], ast.Name):
                try:
                    parts = self.resolve(node.value)
                except Escape as e:
                    self.problems.append(str(e))
                    continue
                if parts is not None:
                    self.names[node.targets[0].id] = parts
        for node in ast.walk(tree):
            if isinstance(node, (ast.Attribute, ast.Subscript, ast.BinOp, ast.Call)):
                try:
                    self.resolve(node)
                except Escape as e:
                    self.problems.append(str(e))
        return sorted(set(self.problems))


def python_problems(source: str, rel: str) -> list[str]:
    return _PathResolver(PurePosixPath(rel)).check(ast.parse(source))


SHELL_UP = re.compile(r"""\$\(\s*dirname\s+["']?\$(?:0|\{BASH_SOURCE\[0\]\}|BASH_SOURCE)"""
                      r"""["']?\s*\)((?:/\.\.)+)""")


def shell_problems(source: str, rel: str) -> list[str]:
    depth = len(PurePosixPath(rel).parts) - 1  # folders between the root and the script
    out = []
    for m in SHELL_UP.finditer(source):
        ups = m.group(1).count("..")
        if ups > depth:
            line = source[: m.start()].count("\n") + 1
            out.append(f"line {line}: `{m.group(0)}` goes {ups - depth} level(s) above the repo")
    return out


def text_problems(source: str) -> list[str]:
    out = []
    for lineno, line in enumerate(source.splitlines(), 1):
        for pattern, why in FORBIDDEN_TEXT:
            if pattern.search(line):
                out.append(f"line {lineno}: {why}: {line.strip()[:120]}")
    return out


def problems_of(path: Path) -> list[str]:
    rel = path.relative_to(ROOT).as_posix()
    source = path.read_text(errors="replace")
    found = text_problems(source)
    if path.suffix == ".py":
        found += python_problems(source, rel)
    elif path.suffix == ".sh" or source.startswith("#!"):
        found += shell_problems(source, rel)
    return found


def test_scan_covers_the_code():
    files = {p.relative_to(ROOT).as_posix() for p in _tracked_files()}
    for expected in ("vllm_subspec/draft_model/substitute_cache.py", "subspec_testing/assets.py",
                     "benchmarks/depth_sweep.py", "scripts/setup.sh", ".ci/run", "Dockerfile"):
        if (ROOT / expected).exists():
            assert expected in files, expected
    assert len(files) > 20


def test_no_code_path_leaves_the_repository():
    this = Path(__file__).resolve()
    report = {p.relative_to(ROOT).as_posix(): probs for p in _tracked_files()
              if p.resolve() != this and (probs := problems_of(p))}
    assert not report, report


@pytest.mark.parametrize("snippet, rel, bad", [
    ("ROOT = Path(__file__).resolve().parent.parent", "benchmarks/x.py", False),
    ("ROOT = Path(__file__).resolve().parent.parent.parent", "benchmarks/x.py", True),
    ("R = Path(__file__).resolve().parent / 'results'\nX = R.parent.parent", "benchmarks/x.py",
     False),
    ("R = Path(__file__).resolve().parent / 'results'\nX = R.parent.parent.parent",
     "benchmarks/x.py", True),
    ("p = Path(__file__).parents[1] / 'Dockerfile'", "tests/x.py", False),
    ("p = Path(__file__).parents[2]", "tests/x.py", True),
    ("p = Path(__file__).parent / '..' / '..' / 'shared_notes'", "tests/x.py", True),
    ("p = os.path.join(os.path.dirname(__file__), '..', '..')", "tests/x.py", True),
    ("p = os.path.join(os.path.dirname(__file__), '..')", "tests/x.py", False),
    ("p = Path(__file__).resolve().parents[3]", "tests/gpu/x.py", True),
    ("p = Path(__file__).resolve().parents[2]", "tests/gpu/x.py", False),
    ("x = tree.parents[0, 1:3]", "tests/x.py", False),
    ("p = Path(spec.origin).parent.parent.parent", "tests/x.py", False),
])
def test_python_checker(snippet, rel, bad):
    assert bool(python_problems(snippet, rel)) == bad


@pytest.mark.parametrize("snippet, rel, bad", [
    ('cd "$(dirname "$0")/.."', "scripts/setup.sh", False),
    ('cd "$(dirname "$0")/../.."', "scripts/setup.sh", True),
    ('cd "$(dirname "$0")/.."', ".ci/run", False),
    ('cd "$(dirname "${BASH_SOURCE[0]}")/../../shared"', ".ci/run", True),
])
def test_shell_checker(snippet, rel, bad):
    assert bool(shell_problems(snippet, rel)) == bad


@pytest.mark.parametrize("line, bad", [
    ("open('/work/shared/notes/x.md')", True),
    ("NOTES = ROOT.parent / 'shared/notes'", True),
    ('cat ../shared/x', True),
    ("ls /mnt/data", True),
    ("# framework/ and the shared KV cache", False),
    ("share = 100 * a / b  # shared/resident layers", False),
    ("WORKDIR /opt/vllm-subspec", False),
])
def test_text_checker(line, bad):
    assert bool(text_problems(line)) == bad
