"""Repository checks, one fast script (run by .ci/run before the suite; tests/unit/test_repo_checks.py
runs it too and tests each checker on snippets):

1. paths: nothing may read outside the repository (a clone works with no sibling folders): no
   absolute path into this workplace (`/work`, `/mnt`), no `shared/` folder reference; Python
   paths derived from `__file__` (`.parent`, `.parents[i]`, `/ ".."`, `os.path.dirname`,
   `os.path.join(..., "..")`, names bound to such paths) and shell `$(dirname "$0")/..` chains
   are resolved symbolically and must stay inside the root;
2. `model_runner.model`: never read it (under CUDA graphs it is vLLM's CUDAGraphWrapper, which
   does not forward the model's attributes; `get_model()` unwraps it);
3. layers: the package's folders import as docs/architecture.md draws them: `vllm_hooks/` is the
   only code that reaches into vLLM's runner, engine, drafters, attention backends or forward
   context; `step/` and `draft_model/` import neither `vllm_hooks/` nor each other, and from
   vLLM only kernels and ops (`step/`) or model-loading code and config (`draft_model/`).

    python scripts/repo_checks.py      # prints each problem, exits 1 if there is one
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path, PurePosixPath

ROOT = Path(__file__).resolve().parent.parent
SCANNED_DIRS = ("vllm_subspec", "subspec_testing", "tests", "benchmarks", "scripts", ".ci")
SCANNED_ROOT_FILES = ("Dockerfile", "pyproject.toml")
CODE_SUFFIXES = (".py", ".sh", ".toml", ".cfg", ".yml", ".yaml", "")
# the checks and their tests hold the patterns they look for
EXEMPT = ("scripts/repo_checks.py", "tests/unit/test_repo_checks.py")

# `/work/...`, `/mnt/...` as a path (not e.g. "framework/"); a `shared/` folder as a path component
FORBIDDEN_TEXT = [
    (re.compile(r"(?<![\w.-])/(?:work|mnt)(?:/|\b)"), "absolute path into the workplace"),
    (re.compile(r"(?:\.\./|/|[\"'`=])shared/"), "reference to a `shared/` folder"),
]


class Escape(Exception):
    pass


def tracked_files() -> list[Path]:
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


def path_problems(path: Path) -> list[str]:
    rel = path.relative_to(ROOT).as_posix()
    source = path.read_text(errors="replace")
    found = text_problems(source)
    if path.suffix == ".py":
        found += python_problems(source, rel)
    elif path.suffix == ".sh" or source.startswith("#!"):
        found += shell_problems(source, rel)
    return found


MODEL_RUNNER_MODEL = re.compile(r"model_runner\.model\b(?!_)")


def model_runner_model_problems(source: str) -> list[str]:
    out = []
    for lineno, line in enumerate(source.splitlines(), 1):
        if MODEL_RUNNER_MODEL.search(line.split("#")[0]):  # comments may name it
            out.append(f"line {lineno}: reads model_runner.model (use get_model()): "
                       f"{line.strip()[:100]}")
    return out


# vLLM modules only vllm_hooks/ may import (the runner, engine, drafters, attention backends,
# forward context, sampler outputs); what step/ and draft_model/ may import from vLLM
HOOKS_ONLY = ("vllm.v1.worker", "vllm.engine", "vllm.entrypoints", "vllm.v1.spec_decode",
              "vllm.v1.attention", "vllm.forward_context", "vllm.v1.outputs",
              "vllm.v1.sample.rejection_sampler", "vllm.model_executor.layers.attention_layer_base")
# (step/ applies vLLM's sampling rules itself: its ops and its logits processors' state)
ALLOWED_VLLM = {"step": ("vllm._custom_ops", "vllm.v1.sample.ops",
                         "vllm.v1.sample.logits_processor", "vllm.model_executor.layers.utils",
                         "vllm.utils.torch_utils"),
                # (the draft runs vLLM's layers, and their tensor-parallel collectives)
                "draft_model": ("vllm.model_executor", "vllm.config", "vllm.distributed")}
SIBLINGS = {"step": ("vllm_subspec.vllm_hooks", "vllm_subspec.draft_model"),
            "draft_model": ("vllm_subspec.vllm_hooks", "vllm_subspec.step")}


def _imports(tree: ast.AST) -> list[tuple[int, str]]:
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            out += [(node.lineno, f"{node.module}.{a.name}") for a in node.names]
    return out


def _under(name: str, prefixes) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def layer_problems(source: str, rel: str) -> list[str]:
    parts = PurePosixPath(rel).parts
    if len(parts) < 3 or parts[0] != "vllm_subspec":
        return []
    folder = parts[1]
    out = []
    for lineno, name in _imports(ast.parse(source)):
        if folder in SIBLINGS and _under(name, SIBLINGS[folder]):
            out.append(f"line {lineno}: {folder}/ imports {name}")
        elif folder in ALLOWED_VLLM and _under(name, ("vllm",)) and name != "vllm" \
                and not _under(name, ALLOWED_VLLM[folder]):  # `import vllm`: its version
            out.append(f"line {lineno}: {folder}/ imports {name} (vLLM internals belong in "
                       "vllm_hooks/)")
        elif folder != "vllm_hooks" and _under(name, HOOKS_ONLY):
            out.append(f"line {lineno}: {name} is imported outside vllm_hooks/")
    return out


def all_problems() -> dict[str, list[str]]:
    """file -> problems, over every scanned file."""
    report = {}
    for path in tracked_files():
        rel = path.relative_to(ROOT).as_posix()
        if rel in EXEMPT:
            continue
        found = path_problems(path)
        if path.suffix == ".py":
            source = path.read_text(errors="replace")
            found += model_runner_model_problems(source) + layer_problems(source, rel)
        if found:
            report[rel] = found
    return report


def main() -> int:
    report = all_problems()
    for rel, problems in report.items():
        for problem in problems:
            print(f"{rel}: {problem}")
    print(f"repo checks: {sum(map(len, report.values()))} problem(s) in "
          f"{len(tracked_files())} files", file=sys.stderr)
    return 1 if report else 0


if __name__ == "__main__":
    sys.exit(main())
