"""`vllm serve` subprocesses on loopback, for the serving tests and the server soak.

- `serving(model, {"plain": None, "subspec": {...}}, log_dir, ...)`: starts the servers in
  parallel, waits until each answers /health, yields `Server`s and always stops them (the API
  server and every process under it: the engine core and its worker);
- `Server`: the process, its base URL, its log, an `openai` client, /metrics;
- `metric_total` reads a Prometheus sample from /metrics; `log_problems` finds tracebacks and
  ERROR lines in a server log.

Servers bind 127.0.0.1 only. They stay in the caller's process group (a runner that kills the
group kills them too) and get SIGTERM if the thread that started them dies (Linux
PR_SET_PDEATHSIG), so a killed test run leaves no server behind. Settings default to the serving
tests' own: float32 (greedy output does not depend on how concurrent requests happen to be
batched), eager mode (`eager=False`: vLLM's default compiled mode), seed 0.
"""

from __future__ import annotations

import ctypes
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

HOST = "127.0.0.1"


class ServerStartError(RuntimeError):
    pass


def free_port(candidates: Iterable[int] | None = None) -> int:
    """A port on 127.0.0.1 that nothing is bound to now: the first free one of `candidates`, else
    one the OS picks (from its ephemeral range)."""
    for port in candidates or ():
        with socket.socket() as s:
            try:
                s.bind((HOST, port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def serve_command(
    model: str,
    port: int,
    spec: dict | None = None,
    *,
    max_model_len: int,
    kv_cache_bytes: int,
    dtype: str = "float32",
    seed: int = 0,
    eager: bool = True,
    extra_args: Iterable[str] = (),
) -> list[str]:
    """eager=False: vLLM's default mode, as `vllm serve` users run it (on the CPU backend, the
    model compiled with inductor and a profiling run at start-up)."""
    cmd = [
        shutil.which("vllm") or "vllm",
        "serve",
        model,
        "--host",
        HOST,
        "--port",
        str(port),
        *(["--enforce-eager"] if eager else []),
        "--dtype",
        dtype,
        "--seed",
        str(seed),
        "--max-model-len",
        str(max_model_len),
        "--kv-cache-memory-bytes",
        str(kv_cache_bytes),
    ]
    if spec:
        cmd += ["--speculative-config", json.dumps(spec)]
    return cmd + list(extra_args)


@dataclass
class Server:
    name: str
    proc: subprocess.Popen
    base: str  # http://127.0.0.1:PORT
    log: Path

    def client(self, **kw):
        from openai import OpenAI

        return OpenAI(base_url=self.base + "/v1", api_key="none", **{"max_retries": 0, **kw})

    def async_client(self, **kw):
        from openai import AsyncOpenAI

        return AsyncOpenAI(base_url=self.base + "/v1", api_key="none", **{"max_retries": 0, **kw})

    def alive(self) -> bool:
        return self.proc.poll() is None

    def healthy(self, timeout: float = 5) -> bool:
        try:
            with urllib.request.urlopen(self.base + "/health", timeout=timeout) as r:
                return r.status == 200
        except OSError:
            return False

    def metrics(self, timeout: float = 30) -> str:
        with urllib.request.urlopen(self.base + "/metrics", timeout=timeout) as r:
            return r.read().decode()

    def log_text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""


def _die_with_parent() -> None:  # runs in the child between fork and exec
    if sys.platform.startswith("linux"):
        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def _server_env(env) -> dict:
    """The server's environment: this process's, less the SubSpec metrics folder it may have
    named (each server names its own: vllm_hooks/metrics.py)."""
    from vllm_subspec.vllm_hooks.metrics import METRICS_DIR_ENV

    return {k: v for k, v in env.items() if k != METRICS_DIR_ENV}


def start_server(
    name: str,
    model: str,
    log: Path,
    spec: dict | None = None,
    *,
    ports: Iterable[int] | None = None,
    env: dict | None = None,
    **settings,
) -> Server:
    """Start `vllm serve`, output to `log`. settings: the keyword arguments of `serve_command`
    (max_model_len and kv_cache_bytes are required). Call from a thread that outlives the
    server (the main thread): the server gets SIGTERM when that thread exits."""
    port = free_port(ports)
    cmd = serve_command(model, port, spec, **settings)
    log = Path(log)
    with open(log, "w") as out:
        out.write("$ " + " ".join(cmd) + "\n")
        out.flush()
        proc = subprocess.Popen(
            cmd,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=_server_env(os.environ if env is None else env),
            preexec_fn=_die_with_parent,
        )
    return Server(name, proc, f"http://{HOST}:{port}", log)


def wait_healthy(server: Server, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not server.alive():
            raise ServerStartError(
                f"{server.name} server exited with {server.proc.returncode}:\n"
                + server.log_text()[-4000:]
            )
        if server.healthy(timeout=2):
            return
        time.sleep(2)
    raise ServerStartError(
        f"{server.name} server did not come up in {timeout:.0f} s:\n" + server.log_text()[-4000:]
    )


def stop_server(server: Server, timeout: float = 30) -> None:
    """SIGTERM to the API server (it shuts its engine core down), then SIGKILL to whatever of it
    and its descendants (listed before the SIGTERM) is still alive after `timeout` s."""
    import psutil

    try:
        tree = [psutil.Process(server.proc.pid)]
        tree += tree[0].children(recursive=True)
    except psutil.NoSuchProcess:
        tree = []
    if server.proc.poll() is None:
        server.proc.terminate()
    _, alive = psutil.wait_procs(tree, timeout=timeout)
    for p in alive:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=timeout)
    try:
        server.proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        pass


@contextmanager
def serving(
    model: str,
    specs: dict[str, dict | None],
    log_dir: Path,
    *,
    start_timeout: float = 600,
    ports: Iterable[int] | None = None,
    **settings,
) -> Iterator[dict[str, Server]]:
    """One server per entry of `specs` (name -> speculative config or None for plain), started
    in parallel, logs in `log_dir/<name>.log`; every server is stopped on exit, whatever
    happened. ports: preferred ports (tried in order, shared by all servers)."""
    log_dir = Path(log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    ports = list(ports or ())
    servers: dict[str, Server] = {}
    try:
        for name, spec in specs.items():
            taken = {int(s.base.rsplit(":", 1)[1]) for s in servers.values()}
            servers[name] = start_server(
                name,
                model,
                log_dir / f"{name}.log",
                spec,
                ports=[p for p in ports if p not in taken],
                **settings,
            )
        for server in servers.values():
            wait_healthy(server, start_timeout)
        yield servers
    finally:
        for server in servers.values():
            stop_server(server)


def metric_total(metrics_text: str, name: str, **labels: str) -> float:
    """Sum of the samples of metric `name` (exact sample name, e.g. `vllm:num_preemptions_total`)
    whose labels include `labels`; 0.0 when there is none."""
    total = 0.0
    pattern = re.compile(rf"^{re.escape(name)}(?:\{{([^}}]*)\}})? (\S+)$", re.M)
    for m in pattern.finditer(metrics_text):
        got = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1) or ""))
        if all(got.get(k) == v for k, v in labels.items()):
            total += float(m.group(2))
    return total


_PROBLEM = re.compile(
    r"Traceback \(most recent call last\)|\bERROR\b|\bCRITICAL\b|"
    r"EngineDeadError|EngineCore encountered"
)


def log_problems(log_text: str) -> list[str]:
    """Lines of a server log that report an error: tracebacks, ERROR/CRITICAL records, a dead
    engine core."""
    return [line for line in log_text.splitlines() if _PROBLEM.search(line)]
