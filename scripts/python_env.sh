# Sourced, not run, by scripts/setup.sh, scripts/test.sh, scripts/demo.sh and .ci/run: sets PY,
# the interpreter they install into and run with, and prints which one it is.
#
#   a virtual environment is active (the interpreter's sys.prefix is not its base prefix)
#       -> PY is that interpreter, as it is;
#   the interpreter is externally managed (PEP 668: an EXTERNALLY-MANAGED file in its stdlib
#   folder, as Debian's and Ubuntu's python3 have), or SUBSPEC_USE_VENV=1
#       -> a virtual environment is created once at $SUBSPEC_VENV (default
#          ${SUBSPEC_CACHE:-$HOME/.cache/vllm-subspec}/venv) and activated for this shell and its
#          children (VIRTUAL_ENV, PATH: `python3`, `vllm` and `hadolint` are the venv's);
#          PY is its python;
#   otherwise (pyenv, conda, a self-built Python) -> PY is the interpreter, as it is.
#
# The interpreter is $PYTHON, default python3. pip reads its site-wide configuration
# (/etc/pip.conf, /etc/xdg/pip/pip.conf, PIP_* variables) inside the venv as outside it.

subspec_python_env() {
  local base=${PYTHON:-python3} answer kind exe venv
  answer=$("$base" -c '
import os, sys, sysconfig
if sys.prefix != sys.base_prefix:
    kind = "venv"
elif os.path.isfile(os.path.join(sysconfig.get_path("stdlib"), "EXTERNALLY-MANAGED")):
    kind = "managed"
else:
    kind = "plain"
print(kind, sys.executable)') || {
    echo "[python] cannot run '$base' (set PYTHON to a Python 3.10+ interpreter)" >&2
    return 1
  }
  kind=${answer%% *} exe=${answer#* }
  if [ "$kind" = venv ]; then
    PY=$base
    echo "[python] $exe (the active virtual environment ${VIRTUAL_ENV:-$(dirname "$(dirname "$exe")")})"
    return 0
  fi
  if [ "$kind" = plain ] && [ "${SUBSPEC_USE_VENV:-0}" != 1 ]; then
    PY=$base
    echo "[python] $exe (installs into its own site-packages)"
    return 0
  fi
  venv=${SUBSPEC_VENV:-${SUBSPEC_CACHE:-$HOME/.cache/vllm-subspec}/venv}
  if [ "$kind" = managed ]; then
    echo "[python] $exe is externally managed (PEP 668): using the virtual environment $venv"
  else
    echo "[python] SUBSPEC_USE_VENV=1: using the virtual environment $venv (made from $exe)"
  fi
  # A venv whose pip does not run (none yet, or an interrupted creation) is (re)created in place.
  if ! "$venv/bin/python" -m pip --version >/dev/null 2>&1; then
    echo "[python] creating $venv"
    "$base" -m venv "$venv" || {
      echo "[python] could not create a virtual environment with '$base -m venv' (Debian," \
        "Ubuntu: apt-get install python3-venv; or activate a venv of your own and rerun)" >&2
      return 1
    }
  fi
  venv=$(cd "$venv" && pwd)  # absolute: PATH and VIRTUAL_ENV outlive the current folder
  export VIRTUAL_ENV=$venv
  case "$PATH" in
    "$venv/bin:"*) ;;
    *) export PATH="$venv/bin:$PATH" ;;
  esac
  PY=$venv/bin/python
}

subspec_python_env || return 1
