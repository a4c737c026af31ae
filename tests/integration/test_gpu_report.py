"""scripts/gpu_check.sh's report: built from pytest's real JUnit XML and the benchmark's JSON."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

from gpu_report import report  # noqa: E402


def test_report_from_a_real_junit_file(tmp_path):
    xml = tmp_path / "t.xml"
    # tests/gpu on a machine without CUDA: every test is collected and skipped
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                    str(ROOT / "tests" / "gpu"), f"--junitxml={xml}"], cwd=ROOT,
                   capture_output=True, timeout=300)
    bench = tmp_path / "b.json"
    bench.write_text(json.dumps({"tau": 21.5, "plain_tokens_per_second": 3.0,
                                 "subspec_tokens_per_second": 15.0, "h2d_bandwidth_gbps": 24.1,
                                 "graph_replays_per_step": 1450.0, "host_syncs_per_step": 2.0,
                                 "identical": "10/10"}))
    text = report(xml, 0, bench, 0)
    assert "tests/gpu: 0 passed, 0 failed" in text
    assert text.count("| skipped | needs a CUDA GPU |") >= 9
    assert "| tau | 21.500 |" in text and "| h2d_bandwidth_gbps | 24.100 |" in text
    assert "| graph_replays_per_step | 1450.000 |" in text
    assert "| host_syncs_per_step | 2.000 |" in text
    missing = report(tmp_path / "none.xml", 1, tmp_path / "none.json", 1)
    assert "| tests/gpu | not run |" in missing and "did not finish" in missing
