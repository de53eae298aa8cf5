"""glibc malloc settings, A/B in one process: the launcher's settings (turnkv/launch.py) against
glibc-like defaults, applied with mallopt(3) in alternating repetitions of a 1,000-token prefill
and 16 decode steps.

    .venv/bin/python bench/malloc.py smollm2-135m native
    .venv/bin/python bench/malloc.py gemma3-270m auto

("default" sets glibc's documented defaults explicitly, which also switches off its dynamic mmap
threshold; a process started without any setting may differ a little.)
"""
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import torch  # noqa: E402
from turnkv.launch import RECOMMENDED_MALLOC, MallocSettings, apply_malloc, configure_process  # noqa: E402
from turnkv.loading import load_checkpoint  # noqa: E402
from turnkv.models import family_class  # noqa: E402
from turnkv.models.weights import load_model  # noqa: E402
from turnkv.cache.specs import make_caches  # noqa: E402
configure_process(None, malloc=None)
DEFAULT = MallocSettings(mmap_threshold=128 * 1024, trim_threshold=128 * 1024, top_pad=0)
name = sys.argv[1] if len(sys.argv) > 1 else "smollm2-135m"
fmt = sys.argv[2] if len(sys.argv) > 2 else "native"
ck = load_checkpoint(name, dtype=torch.float32, progress=False)
m = load_model(family_class(ck.architecture), ck.config, ck.tensors, torch.float32, fmt).eval()
ids = torch.randint(100, 20000, (1000,))
res = {"default": ([], []), "tuned": ([], [])}
with torch.inference_mode():
    for rep in range(4):
        for key, st in (("default", DEFAULT), ("tuned", RECOMMENDED_MALLOC)):
            apply_malloc(st)
            c = make_caches(m.cache_specs(), dtype=torch.float32)
            t = time.perf_counter(); m.step(ids, c, logits="last"); p = time.perf_counter() - t
            tok = torch.tensor([5]); t = time.perf_counter()
            for _ in range(16): m.step(tok, c, logits="last")
            d = time.perf_counter() - t
            res[key][0].append(1000 / p); res[key][1].append(16 / d)
for k, (p, d) in res.items():
    print(f"{name} {fmt} malloc {k:8s} prefill {statistics.median(p):7.0f} tok/s  decode {statistics.median(d):6.1f} tok/s  ({[round(x) for x in p]}, {[round(x,1) for x in d]})")
