"""vLLM's OpenAI server with the plugin: start on 127.0.0.1, one completion, clean stop."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from engine_job import engine_kwargs

START_TIMEOUT_S = 180
STOP_TIMEOUT_S = 30


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(url: str, timeout: float = 2.0) -> int:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return response.status


def post(url: str, body: dict, timeout: float = 60.0) -> dict:
    request = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read())


def group_alive(pgid: int, grace_s: float = 10.0) -> bool:
    """True while any process of group ``pgid`` still runs after ``grace_s``."""
    deadline = time.monotonic() + grace_s
    while True:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return False
        if time.monotonic() > deadline:
            return True
        time.sleep(0.2)


def server_command(model: str, port: int, sparse_kv_dtype: str | None = None) -> list[str]:
    kw = engine_kwargs(model, sparse_kv_dtype)
    command = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--host=127.0.0.1",
        f"--port={port}",
        f"--model={model}",
        f"--dtype={kw['dtype']}",
        f"--max-model-len={kw['max_model_len']}",
        f"--kv-cache-memory-bytes={kw['kv_cache_memory_bytes']}",
        f"--compilation-config={json.dumps(kw['compilation_config'])}",
        f"--attention-backend={kw['attention_config']['backend']}",
        "--enforce-eager",
    ]
    if sparse_kv_dtype is not None:
        command += [
            f"--kv-cache-dtype={kw['kv_cache_dtype']}",
            f"--block-size={kw['block_size']}",
            "--no-enable-prefix-caching",
        ]
    return command


def serve_one_completion(model: Path, tmp_path: Path, sparse_kv_dtype: str | None = None) -> str:
    """Start the server, ask for one completion, stop it cleanly; its log."""
    port = free_port()
    log_path = tmp_path / "server.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            server_command(str(model), port, sparse_kv_dtype),
            stdout=log,
            stderr=subprocess.STDOUT,
            # DEBUG: the plugin's per-feature start-up lines (INFO shows one short line)
            env={**os.environ, "VLLM_MLA": "1", "VLLM_LOGGING_LEVEL": "DEBUG"},
            cwd=tmp_path,  # not the repository root: an egg-info there shadows the plugin
            start_new_session=True,  # its own process group: the stop reaches every child
        )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            assert proc.poll() is None, f"server exited early:\n{log_path.read_text()[-4000:]}"
            try:
                if get(f"{base}/health") == 200:
                    break
            except (urllib.error.URLError, OSError):
                pass
            assert time.monotonic() < deadline, "server not healthy in time"
            time.sleep(0.5)
        body = {"model": str(model), "prompt": "Brai stou dra", "max_tokens": 6}
        reply = post(f"{base}/v1/completions", {**body, "temperature": 0})
        assert reply["choices"][0]["finish_reason"] in ("length", "stop")
        assert reply["usage"]["completion_tokens"] >= 1
    finally:
        proc.send_signal(signal.SIGTERM)  # the server's PID only: it stops its engine itself
        try:
            code = proc.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise AssertionError(f"server ignored SIGTERM for {STOP_TIMEOUT_S} s") from None
    log = log_path.read_text()
    assert code in (0, -signal.SIGTERM), f"exit code {code}"
    assert not group_alive(proc.pid), "server left processes behind"
    return log


def test_openai_server_serves_a_completion_and_stops(models, tmp_path):
    log = serve_one_completion(models["first"], tmp_path)
    # the plugin registered in the serving processes (front end and engine core)
    summary = next(line for line in log.splitlines() if "vllm-mla 0.32" in line)
    assert (
        "applied cpu-mxfp8, lifecycle, lifecycle-cpu, query, sparse, sparse-cpu, wake-check"
        in summary
    )
    not_applied = "not applied: dsv4-gpu (for cuda only), sparse-indexer (for cuda only)"
    assert not_applied in summary and len(summary) < 400
    assert "lifecycle: applied MLAAttention.process_weights_after_loading" in log  # DEBUG
    assert "registered B12X_MLA_SPARSE" in log and "vllm_mla.register()" in log
    assert "and CUSTOM" not in log  # nothing selected the sparse backend: the slot stays free


def test_openai_server_serves_a_dsa_model_through_b12x_mla_sparse(sparse_models, tmp_path):
    """``--attention-backend B12X_MLA_SPARSE`` by name on the command line."""
    log = serve_one_completion(sparse_models["first"], tmp_path, sparse_kv_dtype="fp8")
    assert "sparse-cpu: applied" in log
    # the engine core unpickles the config before it loads plugins: the name travels as CUSTOM
    assert "B12X_MLA_SPARSE is carried in the config as CUSTOM" in log
    # ...and the engine core, spawned after the claim, registered the slot at plugin load
    assert "and CUSTOM (VLLM_MLA_SPARSE_CUSTOM=1)" in log
    assert "Sparse Attention is not supported on CPU" not in log
