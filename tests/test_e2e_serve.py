"""`vllm serve ... --speculative-config '{"method":"subspec"}'` serves OpenAI requests on CPU."""

import json
import os
import re
import shutil
import socket
import subprocess
import time
import urllib.request

import pytest

pytestmark = pytest.mark.e2e


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(smollm2, tmp_path_factory):
    port = free_port()
    log = tmp_path_factory.mktemp("serve") / "server.log"
    spec = json.dumps({"method": "subspec", "num_speculative_tokens": 4,
                       "substitute_layers": "all"})
    cmd = [shutil.which("vllm") or "vllm", "serve", smollm2, "--host", "127.0.0.1",
           "--port", str(port), "--speculative-config", spec, "--enforce-eager",
           "--max-model-len", "2048", "--gpu-memory-utilization", "0.3"]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=dict(os.environ))
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 400
        while time.time() < deadline:
            assert proc.poll() is None, log.read_text()[-4000:]
            try:
                with urllib.request.urlopen(base + "/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                time.sleep(2)
        else:
            pytest.fail("server did not come up:\n" + log.read_text()[-4000:])
        yield base, smollm2
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


def test_chat_completion_and_spec_metrics(server):
    from openai import OpenAI

    base, model = server
    client = OpenAI(base_url=base + "/v1", api_key="none")
    reply = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Name three primary colors."}],
        temperature=0, max_tokens=48)
    assert reply.choices[0].message.content.strip()
    assert reply.usage.completion_tokens > 8
    with urllib.request.urlopen(base + "/metrics", timeout=10) as r:
        text = r.read().decode()
    drafts = float(re.search(r"^vllm:spec_decode_num_drafts_total\{[^}]*\} (\S+)", text,
                             re.M).group(1))
    accepted = float(re.search(r"^vllm:spec_decode_num_accepted_tokens_total\{[^}]*\} (\S+)",
                               text, re.M).group(1))
    assert drafts > 0 and accepted > 0
    assert 1 < 1 + accepted / drafts <= 5  # τ within (1, k + 1]
