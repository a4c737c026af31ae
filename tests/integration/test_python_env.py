"""scripts/python_env.sh, the interpreter choice of setup.sh, test.sh, demo.sh and .ci/run:
an active venv or an interpreter that may install packages is used as it is; an externally
managed one (PEP 668) gets a virtual environment, created once and activated. Stub interpreters
answer the helper's probe as each kind would; one test uses Debian's real python3 where it is."""

import os
import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
HELPER = REPO / "scripts" / "python_env.sh"

# A base interpreter: answers the probe (`-c CODE`) as $STUB_KIND and makes a venv whose python
# answers as a venv's and runs `-m pip --version`; every call is logged.
BASE_STUB = """#!/usr/bin/env bash
printf 'base %s\\n' "$*" >> "$STUB_LOG"
case $1 in
  -c) echo "$STUB_KIND $0" ;;
  -m) [ "$2" = venv ] && [ "${STUB_VENV_FAILS:-0}" = 0 ] || exit 1
      mkdir -p "$3/bin" && cp "$VENV_STUB" "$3/bin/python" ;;
  *) exit 1 ;;
esac
"""
VENV_STUB = """#!/usr/bin/env bash
printf 'venv %s\\n' "$*" >> "$STUB_LOG"
case $1 in
  -c) echo "venv $0" ;;
  -m) [ "$2 $3" = "pip --version" ] ;;
  *) exit 1 ;;
esac
"""
REPORT = 'printf "PY=%s\\nVIRTUAL_ENV=%s\\nPATH=%s\\n" "$PY" "${VIRTUAL_ENV:-}" "$PATH"'


@pytest.fixture
def stubs(tmp_path):
    for name, text in (("python-base", BASE_STUB), ("python-venv", VENV_STUB)):
        (tmp_path / name).write_text(text)
        (tmp_path / name).chmod(0o755)
    return tmp_path


def source(tmp_path, kind="plain", times=1, **env):
    """Sources the helper `times` times in one `set -euo pipefail` shell with the base stub as
    $PYTHON; returns (returncode, the last report as a dict, stdout + stderr, the stub log)."""
    log = tmp_path / "calls.log"
    full = {k: v for k, v in os.environ.items()
            if k not in ("VIRTUAL_ENV", "SUBSPEC_VENV", "SUBSPEC_CACHE", "SUBSPEC_USE_VENV")}
    full.update(PYTHON=str(tmp_path / "python-base"), STUB_KIND=kind, STUB_LOG=str(log),
                VENV_STUB=str(tmp_path / "python-venv"), HOME=str(tmp_path / "home"))
    full.update(env)
    script = "set -euo pipefail\n" + f'source "{HELPER}"\n{REPORT}\n' * times
    proc = subprocess.run(["bash", "-c", script], env=full, capture_output=True, text=True,
                          cwd=REPO, timeout=60)
    report = dict(line.split("=", 1) for line in proc.stdout.splitlines()
                  if re.match(r"(PY|VIRTUAL_ENV|PATH)=", line))
    calls = log.read_text().splitlines() if log.exists() else []
    return proc.returncode, report, proc.stdout + proc.stderr, calls


def test_an_interpreter_that_may_install_is_used_as_it_is(stubs):
    rc, report, out, calls = source(stubs, "plain")
    assert rc == 0, out
    assert report["PY"] == str(stubs / "python-base")
    assert report["VIRTUAL_ENV"] == "" and report["PATH"] == os.environ["PATH"]
    assert not [c for c in calls if "-m venv" in c]
    assert "installs into its own site-packages" in out


def test_an_active_venv_is_used_as_it_is(stubs):
    rc, report, out, calls = source(stubs, "venv")
    assert rc == 0, out
    assert report["PY"] == str(stubs / "python-base") and report["PATH"] == os.environ["PATH"]
    assert not [c for c in calls if "-m venv" in c]
    assert "active virtual environment" in out


def test_an_externally_managed_interpreter_gets_one_venv(stubs):
    venv = stubs / "venvs" / "subspec"
    rc, report, out, calls = source(stubs, "managed", times=2, SUBSPEC_VENV=str(venv))
    assert rc == 0, out
    assert report["PY"] == f"{venv}/bin/python" and report["VIRTUAL_ENV"] == str(venv)
    assert report["PATH"] == f"{venv}/bin:{os.environ['PATH']}"  # activated, once
    assert "externally managed" in out and str(venv) in out
    assert [c for c in calls if "-m venv" in c] == [f"base -m venv {venv}"]
    # A later script (a new shell) reuses it.
    rc, report, out, calls = source(stubs, "managed", SUBSPEC_VENV=str(venv))
    assert rc == 0 and report["PY"] == f"{venv}/bin/python", out
    assert len([c for c in calls if "-m venv" in c]) == 1


def test_the_venv_lives_in_the_subspec_cache_unless_named(stubs):
    rc, report, out, _ = source(stubs, "managed", SUBSPEC_CACHE=str(stubs / "cache"))
    assert rc == 0 and report["VIRTUAL_ENV"] == str(stubs / "cache" / "venv"), out
    rc, report, out, _ = source(stubs, "managed")
    assert rc == 0, out
    assert report["VIRTUAL_ENV"] == str(stubs / "home" / ".cache" / "vllm-subspec" / "venv")


def test_subspec_use_venv_makes_one_for_any_interpreter(stubs):
    venv = stubs / "v"
    rc, report, out, calls = source(stubs, "plain", SUBSPEC_USE_VENV="1", SUBSPEC_VENV=str(venv))
    assert rc == 0 and report["PY"] == f"{venv}/bin/python", out
    assert [c for c in calls if "-m venv" in c] == [f"base -m venv {venv}"]


def test_failures_stop_the_calling_script(stubs):
    rc, report, out, _ = source(stubs, "managed", STUB_VENV_FAILS="1",
                                SUBSPEC_VENV=str(stubs / "v"))
    assert rc != 0 and "PY" not in report and "python3-venv" in out
    rc, report, out, _ = source(stubs, PYTHON=str(stubs / "no-such-python"))
    assert rc != 0 and "PY" not in report and "cannot run" in out


def test_the_scripts_run_the_interpreter_it_picks():
    for rel in ("scripts/setup.sh", "scripts/test.sh", "scripts/demo.sh", ".ci/run"):
        text = (REPO / rel).read_text()
        assert "source scripts/python_env.sh" in text, rel
        assert not re.search(r"^\s*(exec\s+)?python3?\s", text, re.M), rel  # "$PY" instead


DEBIAN_PYTHON = Path("/usr/bin/python3")


@pytest.mark.skipif(not any(DEBIAN_PYTHON.parent.parent.glob("lib/python3*/EXTERNALLY-MANAGED")),
                    reason="no externally managed /usr/bin/python3 here")
def test_a_real_externally_managed_python_gets_a_working_venv(tmp_path):
    venv = tmp_path / "venv"
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "SUBSPEC_USE_VENV")}
    env.update(PYTHON=str(DEBIAN_PYTHON), SUBSPEC_VENV=str(venv))
    script = (f'set -euo pipefail\nsource "{HELPER}"\n"$PY" -c "import sys; print(sys.prefix)"\n'
              '"$PY" -m pip --version\n'
              f'unset PYTHON\nsource "{HELPER}"\n{REPORT}\n')  # python3 now: the active venv's
    proc = subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True,
                          timeout=120)
    out = proc.stdout + proc.stderr
    if proc.returncode != 0 and "python3-venv" in out:
        pytest.skip("Debian's python3 has no venv module here (python3-venv)")
    assert proc.returncode == 0, out
    assert "externally managed" in out and "active virtual environment" in out
    assert f"\n{venv}\n" in out and "PY=python3\n" in out and f"VIRTUAL_ENV={venv}\n" in out
    assert f"PATH={venv}/bin:" in out and f"from {venv}/" in out  # its own pip
