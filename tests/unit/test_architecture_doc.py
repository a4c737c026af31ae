"""docs/architecture.md stays true to the code: its layout drawing names every module of the
package and nothing that is gone; its seam tables name every vLLM method SubSpec's runner,
workers and executor override, and only real methods."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "architecture.md"


def section(text: str, heading: str) -> str:
    start = text.index(f"\n{heading}\n")
    end = text.find("\n## ", start + 1)
    return text[start:end if end >= 0 else None]


def drawn_paths(drawing: str) -> set[str]:
    """The files and folders a layout drawing names, as paths: an entry's name(s) come before
    its description (two spaces or more apart), comma-separated; its indentation (two spaces a
    level) puts it in the last folder drawn above it."""
    folders: list[str] = []
    paths = set()
    for line in drawing.splitlines():
        if not line.strip():
            continue
        indent = (len(line) - len(line.lstrip(" "))) // 2
        names = re.split(r"\s{2,}", line.strip())[0]
        if not re.fullmatch(r"[\w./]+(, [\w./]+)*", names) or not re.search(r"\.py|/", names):
            continue  # a description's continuation line
        del folders[indent:]
        for name in names.split(", "):
            path = "/".join([*folders, name.rstrip("/")])
            paths.add(path)
            if name.endswith("/"):
                folders.append(name.rstrip("/"))
    return paths


def package_paths() -> set[str]:
    pkg = ROOT / "vllm_subspec"
    paths = {"vllm_subspec"}
    for p in pkg.rglob("*"):
        rel = p.relative_to(ROOT).as_posix()
        if "__pycache__" in rel or p.name == "__init__.py":
            continue
        if p.is_dir() or p.suffix == ".py":
            paths.add(rel)
    # a folder of non-Python sources is drawn as the folder (csrc/), not file by file
    return {p for p in paths if not any(p.startswith(d + "/") for d in _source_folders())}


def _source_folders() -> set[str]:
    pkg = ROOT / "vllm_subspec"
    return {d.relative_to(ROOT).as_posix() for d in pkg.rglob("*") if d.is_dir()
            and "__pycache__" not in d.parts and not (d / "__init__.py").exists()}


def test_the_layout_drawing_names_every_module_and_nothing_gone():
    drawing = section(DOC.read_text(), "## Layout").split("```")[1]
    drawn, real = drawn_paths(drawing), package_paths()
    assert real - drawn == set(), f"modules missing from the drawing: {sorted(real - drawn)}"
    assert drawn - real == set(), f"drawn but not in the package: {sorted(drawn - real)}"


def test_the_drawing_parser_reads_folders_lists_and_continuations():
    drawing = ("pkg/\n  a.py, b.py          two modules\n                       more text\n"
               "  sub/                a folder\n    c.py                in it\n  d.py   back\n")
    assert drawn_paths(drawing) == {"pkg", "pkg/a.py", "pkg/b.py", "pkg/sub", "pkg/sub/c.py",
                                    "pkg/d.py"}


# ---- the seam ------------------------------------------------------------------------------
SLOTS = {"SampleMatchVerifier.__call__", "SubSpecProposer.propose"}  # vLLM's designed slots


def seam_classes() -> list[tuple[type, type]]:
    """(SubSpec's class, the vLLM class it stands in for) of the runner, workers, executor."""
    from vllm.v1.executor.multiproc_executor import MultiprocExecutor
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    from vllm.v1.worker.gpu_worker import Worker

    from vllm_subspec.vllm_hooks.executor import SubSpecMultiprocExecutor
    from vllm_subspec.vllm_hooks.runner import SubSpecGPUModelRunner, SubSpecGPUWorker

    pairs = [(SubSpecGPUModelRunner, GPUModelRunner), (SubSpecGPUWorker, Worker),
             (SubSpecMultiprocExecutor, MultiprocExecutor)]
    try:
        from vllm.v1.worker.cpu_model_runner import CPUModelRunner
        from vllm.v1.worker.cpu_worker import CPUWorker

        from vllm_subspec.vllm_hooks.cpu_runner import SubSpecCPUModelRunner, SubSpecCPUWorker
    except ImportError:  # vLLM's CPU classes only where this platform has them
        return pairs
    return pairs + [(SubSpecCPUModelRunner, CPUModelRunner), (SubSpecCPUWorker, CPUWorker)]


def overrides(ours: type, theirs: type) -> set[str]:
    """`Class.method` for each method a SubSpec class in `ours`' MRO (a mixin included)
    defines that vLLM's class also has: what SubSpec runs in place of vLLM's."""
    found = set()
    for cls in ours.__mro__:
        if not cls.__module__.startswith("vllm_subspec"):
            continue
        for name, value in vars(cls).items():
            if callable(value) and hasattr(theirs, name) and (
                    name == "__init__" or not name.startswith("__")):
                found.add(f"{cls.__name__}.{name}")
    return found


def seam_table_methods() -> set[str]:
    """The SubSpec methods the seam section's tables name in their 'SubSpec's method' column."""
    text = section(DOC.read_text(), "## The seam: one class, vLLM's calls in vLLM's order")
    named = set()
    for row in re.findall(r"^\|(.+)\|\s*$", text, re.M):
        cells = [c.strip() for c in row.split("|")]
        column = 2 if re.fullmatch(r"\d+", cells[0]) else 1
        named |= set(re.findall(r"`((?:SubSpec|SampleMatch)\w*\.\w+)`", cells[column]))
    return named


def test_the_seam_tables_name_every_override_and_only_real_methods():
    listed = seam_table_methods()
    assert "SubSpecRunner._prepare_inputs" in listed  # the parser found the tables
    expected = set().union(*(overrides(ours, theirs) for ours, theirs in seam_classes()))
    assert expected - listed == set(), f"overrides missing from the seam: {expected - listed}"
    assert listed - expected - SLOTS == set(), \
        f"the seam names methods that override nothing: {sorted(listed - expected - SLOTS)}"


@pytest.mark.parametrize("slot", sorted(SLOTS))
def test_the_slots_the_seam_names_exist(slot):
    from vllm_subspec.vllm_hooks.proposer import SubSpecProposer
    from vllm_subspec.vllm_hooks.verifier import SampleMatchVerifier

    cls, method = slot.split(".")
    assert callable(getattr({"SubSpecProposer": SubSpecProposer,
                             "SampleMatchVerifier": SampleMatchVerifier}[cls], method))
