"""Hugging Face configs no one here wrote, end to end: trace -> bonsai -> export -> verify.

Each architecture is a small config of its own ``transformers`` class (built from the config, no
weights), saved as ``config.json`` and given to bonsai as ``hf:PATH`` exactly as a user's would be.
For each: the traced graph, bonsai's schedule at ``--budget`` of the no-remat peak, the export (replay
back-end), and ``verify`` on CPU: predicted vs measured peak, loss and gradient differences.

    PYTHONPATH=. python scripts/hf_configs.py [--budget 0.7] [--only t5 bart] [-o PAGE]

writes docs/results/hf_configs.md (one markdown row per architecture; ``-o`` another page) and exits 1 if
any fails.
"""

from __future__ import annotations

import argparse
import datetime
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

TEXT = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128, vocab_size=512,
            max_position_embeddings=128)


def configs() -> dict[str, Callable[[], Any]]:
    """architecture -> a function making its small config (imported lazily: transformers is optional)."""
    import transformers as T

    return {
        "distilbert": lambda: T.DistilBertConfig(dim=64, n_layers=2, n_heads=4, hidden_dim=128, vocab_size=512,
                                                 max_position_embeddings=128),
        "roberta": lambda: T.RobertaConfig(**TEXT),
        "electra": lambda: T.ElectraConfig(embedding_size=64, **TEXT),
        "opt": lambda: T.OPTConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, ffn_dim=128,
                                   vocab_size=512, max_position_embeddings=128, word_embed_proj_dim=64),
        "gpt_neox": lambda: T.GPTNeoXConfig(**TEXT),
        "gptj": lambda: T.GPTJConfig(n_embd=64, n_layer=2, n_head=4, vocab_size=512, n_positions=128, rotary_dim=8),
        "qwen2": lambda: T.Qwen2Config(**TEXT, num_key_value_heads=2),
        "phi": lambda: T.PhiConfig(**TEXT),
        "gemma": lambda: T.GemmaConfig(**TEXT, num_key_value_heads=2, head_dim=16),
        "mixtral": lambda: T.MixtralConfig(**TEXT, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2),
        "bloom": lambda: T.BloomConfig(hidden_size=64, n_layer=2, n_head=4, vocab_size=512),
        "falcon": lambda: T.FalconConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=512),
        "bart": lambda: T.BartConfig(d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                                     decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128,
                                     vocab_size=512, max_position_embeddings=128),
        "t5": lambda: T.T5Config(d_model=64, d_ff=128, num_layers=2, num_heads=4, vocab_size=512,
                                 decoder_start_token_id=0, pad_token_id=0),
        "deit": lambda: T.DeiTConfig(image_size=32, patch_size=4, hidden_size=64, num_hidden_layers=2,
                                     num_attention_heads=4, intermediate_size=128, num_labels=10),
        "swin": lambda: T.SwinConfig(image_size=32, patch_size=4, embed_dim=16, depths=[1, 1], num_heads=[2, 4],
                                     window_size=4, num_labels=10),
        "convnext": lambda: T.ConvNextConfig(hidden_sizes=[16, 32, 64, 128], depths=[1, 1, 1, 1], num_labels=10),
        "mobilenet_v2": lambda: T.MobileNetV2Config(image_size=32, num_labels=10, depth_multiplier=0.35),
    }


def run_one(arch: str, make: Callable[[], Any], folder: Path, budget: float, batch: int) -> dict[str, Any]:
    from bonsai_core.export import export_model, verify_export
    from bonsai_core.schedule import no_remat_peak
    from bonsai_core.solvers import solve
    from bonsai_core.trace import trace_model

    make().save_pretrained(folder)
    spec, options = f"hf:{folder}", {"batch": batch}
    start = time.perf_counter()
    graph = trace_model(spec, **options).graph
    traced = time.perf_counter() - start
    schedule = solve(graph, int(budget * no_remat_peak(graph)), "bonsai", time_limit=60)
    out = export_model(spec, options, schedule, folder / "export")
    v = verify_export(spec, options, out, repeats=0)
    return {"arch": arch, "nodes": graph.n, "trace_s": traced, "overhead": schedule.stats["overhead"],
            "predicted": v.predicted_peak, "measured": v.measured_peak, "error": v.peak_error,
            "loss_diff": v.loss_diff, "grad_diff": v.max_grad_diff, "ok": not v.problems()}


COMMAND = "PYTHONPATH=. python scripts/hf_configs.py"
PAGE = """{header}
# Hugging Face configs end to end

`{command}` on {date}, {machine}: each config runs trace → bonsai at {budget:.0%} of the no-remat peak →
export (replay back-end) → verify on CPU, at small sizes (2 layers, width 64; batch {batch}); peaks in
bytes, live-bytes tracker.

| config | nodes | bonsai overhead | predicted peak | measured peak | error | loss / grad diff |
| --- | --- | --- | --- | --- | --- | --- |
{rows}
"""


def row(arch: str, make: Callable[[], Any], budget: float, batch: int) -> tuple[str, bool]:
    """One architecture's markdown row, and whether it verified."""
    with tempfile.TemporaryDirectory() as tmp:
        try:
            r = run_one(arch, make, Path(tmp), budget, batch)
        except Exception as e:  # report and go on: one architecture's failure is a row, not the end
            return f"| {arch} | failed: {type(e).__name__}: {str(e).splitlines()[0][:200]} | | | | | |", False
    return (f"| {arch} | {r['nodes']} | {r['overhead']:+.1%} | {r['predicted']:,} B | {r['measured']:,} B | "
            f"{r['error']:+.2%} | {r['loss_diff']:.1e} / {r['grad_diff']:.1e} |"), r["ok"]


def main() -> int:
    from bonsai_core.bench.common import page_header

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--budget", type=float, default=0.7, help="share of the no-remat peak (default 0.7)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--only", nargs="+", help="architectures to run (default: all)")
    ap.add_argument("-o", "--out", default="docs/results/hf_configs.md", help="the page to write")
    args = ap.parse_args()
    makers = configs()
    rows, failed = [], []
    for arch in args.only or list(makers):
        line, ok = row(arch, makers[arch], args.budget, args.batch)
        print(line, flush=True)
        rows.append(line)
        if not ok:
            failed.append(arch)
    import torch

    Path(args.out).write_text(PAGE.format(
        header=page_header(COMMAND, ["scripts/hf_configs.py"]), command=COMMAND, date=datetime.date.today(),
        machine=f"{platform.machine()} CPU, torch {torch.__version__}", budget=args.budget, batch=args.batch,
        rows="\n".join(rows)))
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
