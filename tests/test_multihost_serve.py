"""`experiments.serve` under the launcher (2 processes x 4 CPU devices, one 8-device mesh), driven by the official
`openai` SDK, against the same server in this process (one device, the unsharded model of the same config and
seed), then stopped by SIGTERM to the launcher.

The 2-process server: the tiny sharded config's random model tensor parallel over a (1, 8) mesh, HTTP and the
scheduler on process 0, whose program calls process 1 replays (`glm53.serving.multihost`), a 1-second idle
heartbeat. Greedy completions (a text prompt, a token-id prompt streamed) and a greedy chat, sent together,
must return the text of the reference server (one request at a time); SIGTERM must stop the server, release
process 1 (it reports the calls it replayed and the heartbeats it received) and leave every process with status
0 and no traceback.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import openai
from starlette.testclient import TestClient

from configs import tiny
from glm53 import build, tokenizer
from glm53.config import model_config_from_dict
from glm53.serving.app import make_app
from glm53.serving.engine import Engine
from glm53.serving.reasoning import THINK_CLOSE, THINK_OPEN
from glm53.serving.text import detokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = "glm53-random"
SLOTS, MAX_LEN, BUCKETS = 2, 64, (1, 16)  # prompts of 16 tokens: one prefill chunk
PROMPT_IDS = [5, 9, 2, 77, 31, 4, 18, 60, 3, 11, 100, 42, 7, 7, 64, 1]
FAST = {"xla_backend_optimization_level": 0}  # shorter compiles, here and (XLA_FLAGS) in the server
BOUND = 300  # seconds: a bound on a hang, not a timing assertion


def _requests(client: openai.OpenAI, together: bool) -> list[tuple[str, int | None]]:
    """(text, completion tokens) of greedy requests: a text completion, a token-id completion streamed (no
    count), a chat; `together`: all at once (the slots decode them in one batch)."""

    def text():
        r = client.completions.create(model=MODEL, prompt="The sea is calm.", max_tokens=5, temperature=0)
        return r.choices[0].text, r.usage.completion_tokens

    def streamed():
        chunks = client.completions.create(
            model=MODEL, prompt=PROMPT_IDS, max_tokens=5, temperature=0, stream=True
        )
        return "".join(x.choices[0].text for x in chunks if x.choices), None

    def chat():
        msgs = [{"role": "user", "content": "hi"}]
        r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=5, temperature=0)
        return r.choices[0].message.content or "", r.usage.completion_tokens

    if not together:
        return [f() for f in (text, streamed, chat)]
    with ThreadPoolExecutor(3) as pool:
        return [f.result() for f in [pool.submit(g) for g in (text, streamed, chat)]]


def _reference() -> list[tuple[str, int | None]]:
    """The requests served here by the one-process server of experiments.serve (as it builds it)."""
    c = tiny.get_config("sharded")
    cfg = model_config_from_dict(c.model)
    model = build.random_model(cfg, seed=c.seed, dtype=build.parse_dtype(c.param_dtype), with_mtp=False,
                               kernels={"moe": "auto"})  # fmt: skip
    tok = tokenizer.load_tokenizer(None, vocab_size=cfg.vocab_size)
    engine = Engine(model, slots=SLOTS, max_len=MAX_LEN, buckets=BUCKETS, eos_ids=cfg.eos_token_ids,
                    decode_widths=(SLOTS,), compiler_options=FAST, prefill_batch=1,
                    detokenize=detokenizer(tok, keep=(THINK_OPEN, THINK_CLOSE)))  # fmt: skip
    with TestClient(make_app(engine, tok, MODEL, log=lambda s: None)) as http:  # runs the app's lifespan
        deadline = time.monotonic() + BOUND
        while not engine.warm:
            assert time.monotonic() < deadline, "the reference engine did not compile"
            time.sleep(0.1)
        client = openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=http, max_retries=0)
        return _requests(client, together=False)


def _healthy(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=10) as r:
            return r.status == 200
    except OSError:
        return False


def test_serve_two_processes_equals_one_process_and_stops_cleanly(tmp_path):
    env = {**os.environ, "PYTHONUNBUFFERED": "1",
           "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} --xla_backend_optimization_level=0".strip()}  # fmt: skip
    cmd = [sys.executable, "-m", "experiments.launch", "--processes=2", "--devices_per_process=4", "--grace=60", "--",
           sys.executable, "-m", "experiments.serve", "--config=configs/tiny.py:sharded", "--port=0",
           "--prefix_cache_mb=0", f"--slots={SLOTS}", f"--max_len={MAX_LEN}", f"--buckets={','.join(map(str, BUCKETS))}",
           "--compilation_cache=", "--heartbeat=1"]  # fmt: skip
    # --compilation_cache= : JAX's cache is conftest's (JAX_COMPILATION_CACHE_DIR in the environment)
    err = tmp_path / "stderr.txt"
    with open(err, "w") as e:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=e, text=True)
    lines: list[str] = []
    try:
        port = None
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("[0] listening on"):
                port = int(line.rsplit(":", 1)[1])
                break
        assert port, f"the server did not start: {''.join(lines)[-2000:]}\n{err.read_text()[-3000:]}"
        reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
        reader.start()
        want = _reference()  # here, while the processes compile
        deadline = time.monotonic() + BOUND
        while not _healthy(port):
            assert proc.poll() is None and time.monotonic() < deadline, err.read_text()[-3000:]
            time.sleep(0.2)
        got = _requests(openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0,
                                      timeout=BOUND), together=True)  # fmt: skip
        proc.send_signal(signal.SIGTERM)
        status = proc.wait(timeout=BOUND)
        reader.join(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    out, stderr = "".join(lines), err.read_text()
    assert got == want
    assert all(t for t, _ in want) and [n for _, n in want] == [5, None, 5]  # text; no EOS in these
    assert status == 0, f"status {status}\n{out[-2000:]}\n{stderr[-4000:]}"
    assert "Traceback" not in out + stderr, stderr[-4000:]
    assert "launch: SIGTERM: passed to process 0" in stderr and "[0] server stopped" in out
    replayed = [line for line in out.splitlines() if line.startswith("[1] replayed ")]
    assert len(replayed) == 1, out[-2000:]
    calls, beats = map(int, re.fullmatch(r"\[1\] replayed (\d+) program calls of process 0 \((\d+) idle heartbeats\)",
                                         replayed[0]).groups())  # fmt: skip
    assert calls > 20 and beats > 0, replayed[0]  # warm-up + the requests' prefill / decode; idle heartbeats
