"""The checkpoint back-end on the replay back-end's test models: bonsai (free-form and module plans) at the
first of lb + 50/70/90% of the headroom it meets, exported with ``export_checkpoint`` and checked with
``verify_checkpoint``; one line per model and plan. ``PYTHONPATH=. python scripts/checkpoint_backend_models.py
[MODEL ...]`` (docs/results/export.md has a run)."""
import sys
import tempfile
import time
from pathlib import Path
from bonsai_core.errors import BonsaiError
from bonsai_core.export.checkpoint import export_checkpoint
from bonsai_core.export.verify import verify_checkpoint
from bonsai_core.schedule import no_remat_peak
from bonsai_core.solvers import solve
from bonsai_core.trace import trace_model

TEXT = dict(batch=2, seq=16, width=32, layers=2, heads=2, vocab=64)
MODELS = {
    "mlp": dict(batch=64, width=32, layers=4),
    "vgg": dict(batch=2, width=4, layers=1, image=16),
    "resnet": dict(batch=2, width=4, layers=1, image=16),
    "unet": dict(batch=1, width=4, layers=2, image=16),
    "gpt": TEXT,
    "tests.export_models:dropout_mlp": {}, "tests.export_models:batchnorm_cnn": {},
    "tests.export_models:unused_param": {}, "tests.export_models:hf_gpt2": {}, "tests.export_models:hf_llama": {},
    "hf:gpt2": TEXT, "hf:bert": TEXT, "hf:llama": TEXT, "hf:vit": dict(batch=2, image=16, width=32, layers=2, heads=2),
    "hf:resnet": dict(batch=4, image=32, width=8, layers=2),
    "tests.real_models:vit_assert": dict(batch=2, image=16, width=32, layers=2, heads=2),
    "tests.real_models:gpt2": dict(batch=2, seq=16, width=32, vocab=64, heads=2),
    "tests.real_models:bert_mlm": dict(batch=2, seq=16, width=32, vocab=64, heads=2),
    "tests.real_models:resnet18_bn": dict(batch=2, image=32, width=8),
    "tests.real_models:mobilenet_v3_small": dict(batch=2, image=32),
}
only = sys.argv[1:] or list(MODELS)
for name in only:
    opts = MODELS[name]
    t0 = time.time()
    try:
        g = trace_model(name, **opts).graph
    except BonsaiError as e:
        print(f"{name}: TRACE REFUSED {str(e)[:150]}", flush=True); continue
    for regions in ("any", "modules"):
        sched = None
        for share in (0.5, 0.7, 0.9):
            lb = g.peak_lower_bound
            try:
                sched = solve(g, int(lb + share * (no_remat_peak(g) - lb)), method="bonsai", regions=regions, time_limit=30)
                break
            except BonsaiError:
                continue
        if sched is None:
            print(f"{name} {regions}: no plan", flush=True); continue
        out = Path(tempfile.mkdtemp()) / "ck"
        try:
            export_checkpoint(name, opts, sched, out)
            v = verify_checkpoint(name, opts, out, repeats=1)
            print(f"{name} {regions} share {share}: loss {v.loss_diff:.2g} grad {v.max_grad_diff:.2g} "
                  f"peak err {v.peak_error} realised err {v.realised_peak_error} problems {v.problems()} "
                  f"({time.time()-t0:.0f}s)", flush=True)
        except BonsaiError as e:
            print(f"{name} {regions}: REFUSED {type(e).__name__}: {str(e)[:300]}", flush=True)
        except Exception as e:
            print(f"{name} {regions}: CRASH {type(e).__name__}: {str(e)[:200]}", flush=True)
