"""The per-request oracles the tests and benchmarks check the plugin against live in
subspec_testing/reference.py, not in the plugin (issue 53): none of them is defined again in
vllm_subspec/, under any class or module."""

import ast
from pathlib import Path

from subspec_testing import reference

ROOT = Path(__file__).resolve().parents[2]

# name in the package before issue 53 -> its function in subspec_testing/reference.py
MOVED = {
    "accepted_path": "accepted_path",  # step/tree.py
    "node_paths": "node_paths",  # step/tree.py, StoredTree's method
    "move_kv": "move_kv",  # step/paged_kv.py, a twin of copy_kv
    "tree_attention_rows": "tree_attention_rows",  # step/tree_attention.py
    "from_quantized": "substitute_experts_from_quantized",  # draft_model/experts.py, classmethod
}


def defined_functions(source: str) -> set[str]:
    """Every function and method name a module defines, at any depth."""
    return {node.name for node in ast.walk(ast.parse(source))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))}


def test_the_oracles_are_not_defined_in_the_package():
    modules = sorted((ROOT / "vllm_subspec").rglob("*.py"))
    assert ROOT / "vllm_subspec" / "step" / "tree.py" in modules
    found = {f"{p.relative_to(ROOT)}: {name}" for p in modules
             for name in defined_functions(p.read_text()) & MOVED.keys()}
    assert found == set(), "test-only oracles belong in subspec_testing/reference.py"


def test_the_reference_module_has_them():
    for name in MOVED.values():
        assert callable(getattr(reference, name)), name


def test_the_check_sees_methods_and_nested_functions():
    source = ("class StoredTree:\n    def node_paths(self, n):\n        pass\n\n\n"
              "def outer():\n    def move_kv():\n        pass\n")
    assert defined_functions(source) & MOVED.keys() == {"node_paths", "move_kv"}
