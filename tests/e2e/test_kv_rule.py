"""The draft may only write KV at not-yet-verified positions, and the tests notice if it doesn't.

An auditor wraps the draft in an in-process engine and checks, at every draft forward, that each
request's position is beyond its last verified token. The negative control re-drafts the last
accepted token (what vLLM's own draft-model first pass does): the auditor must flag it and the
greedy output must diverge from the plain engine, i.e. the losslessness tests would catch it.
fp32, where the honest run must equal plain decoding exactly.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from vllm import SamplingParams

from subspec_testing.assets import chat_prompts, mt_bench_prompts
from subspec_testing.plain_reference import PlainRun

SUPPORT = Path(__file__).resolve().parents[1] / "support"  # probes and shims

pytestmark = pytest.mark.e2e
MAX_TOKENS = 64


@pytest.fixture(scope="module")
def probe(smollm2, tmp_path_factory, plain_references):
    prompts = chat_prompts(smollm2, mt_bench_prompts(4))
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    reference = plain_references.get(smollm2, dict(enable_prefix_caching=False, dtype="float32"),
                                     {"greedy": PlainRun(prompts, params)})["greedy"].token_ids
    d = tmp_path_factory.mktemp("kv_rule")
    (d / "prompts.json").write_text(json.dumps([prompts, MAX_TOKENS]))
    # the probe imports subspec_testing from the repository root (pytest's pythonpath does not
    # reach a child process)
    repo = str(Path(__file__).resolve().parents[2])
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0",
               PYTHONPATH=os.pathsep.join(filter(None, [repo, os.environ.get("PYTHONPATH")])))
    proc = subprocess.run(
        [sys.executable, str(SUPPORT / "kv_rule_probe.py"), smollm2,
         str(d / "prompts.json"), str(d / "out.json")],
        env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return reference, json.loads((d / "out.json").read_text())


def test_draft_writes_only_unverified_positions(probe):
    reference, result = probe
    honest = result["honest"]
    assert honest["checks"] > 50  # the auditor really watched the draft
    assert honest["violations"] == 0
    assert honest["token_ids"] == reference


def test_redrafting_an_accepted_token_is_caught(probe):
    reference, result = probe
    bad = result["redraft"]
    assert bad["checks"] > 0 and bad["violations"] > 0
    # Draft KV overwrote verified KV: the output is no longer the target's.
    assert bad["token_ids"] != reference
