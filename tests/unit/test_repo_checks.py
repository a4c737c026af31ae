"""scripts/repo_checks.py: the repository passes it, and each checker catches what it is for
(a blind checker would pass any repository)."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

import repo_checks as rc  # noqa: E402

# The sibling folder a user's clone does not have; the snippets below only name it, as the code
# the checks must catch would (spelled from parts so that no line here reads like such code).
UP_TO_SIBLING = "../" + "shared"


def test_the_repository_passes_every_check():
    files = {p.relative_to(rc.ROOT).as_posix() for p in rc.tracked_files()}
    for expected in ("vllm_subspec/draft_model/substitute_cache.py", "subspec_testing/assets.py",
                     "benchmarks/depth_sweep.py", "scripts/setup.sh", ".ci/run", "Dockerfile"):
        assert expected in files, expected
    assert rc.all_problems() == {}


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
def test_python_path_checker(snippet, rel, bad):
    assert bool(rc.python_problems(snippet, rel)) == bad


@pytest.mark.parametrize("snippet, rel, bad", [
    ('cd "$(dirname "$0")/.."', "scripts/setup.sh", False),
    ('cd "$(dirname "$0")/../.."', "scripts/setup.sh", True),
    ('cd "$(dirname "${BASH_SOURCE[0]}")/../' + UP_TO_SIBLING + '"', ".ci/run", True),
])
def test_shell_path_checker(snippet, rel, bad):
    assert bool(rc.shell_problems(snippet, rel)) == bad


@pytest.mark.parametrize("line, bad", [
    ("open('/work/shared/notes/x.md')", True),
    ("NOTES = ROOT.parent / 'shared/notes'", True),
    (f"cat {UP_TO_SIBLING}/x", True),
    ("ls /mnt/data", True),
    ("# framework/ and the shared KV cache", False),
    ("WORKDIR /opt/vllm-subspec", False),
])
def test_text_checker(line, bad):
    assert bool(rc.text_problems(line)) == bad


@pytest.mark.parametrize("line, bad", [
    ("m = runner.model_runner.model", True),
    ("m = worker.model_runner.model.lm_head", True),
    ("m = worker.model_runner.model_config", False),
    ("m = worker.model_runner.get_model()  # not model_runner.model", False),
])
def test_model_runner_model_checker(line, bad):
    assert bool(rc.model_runner_model_problems(line)) == bad


@pytest.mark.parametrize("source, rel, bad", [
    ("from vllm.v1.worker.gpu_model_runner import GPUModelRunner", "vllm_subspec/step/x.py", True),
    ("from vllm.forward_context import set_forward_context", "vllm_subspec/draft_model/x.py",
     True),
    ("from vllm.forward_context import set_forward_context", "vllm_subspec/vllm_hooks/x.py",
     False),
    ("from vllm_subspec.vllm_hooks.proposer import SubSpecProposer", "vllm_subspec/step/x.py",
     True),
    ("from vllm_subspec.step.tree import TreeShape", "vllm_subspec/draft_model/x.py", True),
    ("from vllm import _custom_ops as ops", "vllm_subspec/step/x.py", False),
    ("from vllm.config import get_current_vllm_config", "vllm_subspec/step/x.py", True),
    ("from vllm.config import get_current_vllm_config", "vllm_subspec/draft_model/x.py", False),
    ("import vllm", "vllm_subspec/draft_model/x.py", False),
    ("from vllm.v1.outputs import SamplerOutput", "vllm_subspec/config.py", False),
    ("from vllm.v1.outputs import SamplerOutput", "vllm_subspec/plugin_x/x.py", True),
])
def test_layer_checker(source, rel, bad):
    assert bool(rc.layer_problems(source, rel)) == bad
