"""In-process: the default build's RoundScheduler driven like the soak (32 slots, mixed prompts, greedy + seeded,
cancels) — RSS, Python objects and malloc state every N requests. Usage: .venv/bin/python scripts/probe_round_memory.py MINUTES (REPO=build/NAME/model_repo, TRIM=1: malloc_trim after each sample)"""
import ctypes
import gc
import json
import os
import random
import sys
import time
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import soak_mixed as sm
from dspark_trt.serve.openai.app import _config_from_pbtxt
from dspark_trt.serve.config import ServeConfig
from dspark_trt.serve.build_loader import load_backend, load_tokenizer_for
from dspark_trt.serve.text import encode_prompt
from dspark_trt.spec_decode.loop import LoopConfig, Request, RoundScheduler
from dspark_trt.spec_decode.sampling import SamplingParams
from dspark_trt.spec_decode.scheduler import PolicyConfig
from dspark_trt.spec_decode.policies import default_proposers

def rss():
    for l in open('/proc/self/status'):
        if l.startswith('VmRSS'): return int(l.split()[1]) / 1024
libc = ctypes.CDLL("libc.so.6")
minutes = float(sys.argv[1]); trim = os.environ.get("TRIM") == "1"
repo = Path(os.environ.get("REPO", "build/default/model_repo"))
cfg = ServeConfig.from_model_config(_config_from_pbtxt(repo / "dspark" / "config.pbtxt"))
import torch
torch.set_num_threads(2)
loaded = load_backend(cfg)
tok = load_tokenizer_for(cfg)
prompts = sm.prompt_set(14)
ids = [(encode_prompt(tok, p.text, p.chat, 1 << 20), p.max_tokens) for p in prompts]
sched = RoundScheduler(loaded.backend, LoopConfig(gamma=cfg.gamma, prefill_chunk=cfg.prefill_chunk))
rng = random.Random(0)
live = {}
def submit():
    pid, n = rng.choice(ids)
    kind = rng.choices(["greedy", "seeded", "cancel"], [0.6, 0.25, 0.15])[0]
    if kind == "seeded":
        sp = SamplingParams(0.8, 0.95, rng.randrange(1 << 20)); pol = PolicyConfig(policy="fixed", k=7, max_k=7, proposers=("dspark",))
    else:
        sp = SamplingParams(); pol = PolicyConfig(proposers=default_proposers(True))
    rid = sched.add(Request(tuple(pid), n, sp, pol, loaded.eos_ids))
    live[rid] = (kind, 0)
for _ in range(cfg.max_batch): submit()
t0 = time.monotonic(); done = 0; last = 0; base = None; rows = []
while time.monotonic() - t0 < minutes * 60:
    for ev in sched.step():
        kind, n = live[ev.request_id]
        n += len(ev.new_tokens)
        live[ev.request_id] = (kind, n)
        if ev.finished:
            del live[ev.request_id]; done += 1; submit()
        elif kind == "cancel" and n >= 4:
            sched.cancel(ev.request_id); del live[ev.request_id]; done += 1; submit()
    if done - last >= 100:
        last = done
        gc.collect()
        if trim: libc.malloc_trim(0)
        r = rss(); base = base or r
        row = dict(t=round(time.monotonic() - t0), done=done, rss=round(r, 1), growth=round(r - base, 1), objs=len(gc.get_objects()))
        rows.append(row); print(json.dumps(row), flush=True)
