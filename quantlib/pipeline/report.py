"""What a run reports: the summary table it prints, ``report.json`` and ``report.html`` (the per-module
weight error as an inline SVG chart; no plotting library needed)."""

from __future__ import annotations

import html
import json
import os
from typing import Any

import torch

#: tensors of a quantized module that are not its weight's storage (activation / KV scales, bias)
_NOT_WEIGHT = ("bias", "input_scale", "input_global_scale", "k_scale", "v_scale", "input_zero_point")


def weight_error(raw: torch.Tensor, quantized: torch.Tensor) -> float:
    """||W_q - W|| / ||W|| in fp32."""
    raw, quantized = raw.float(), quantized.float()
    norm = raw.norm().item()
    return (quantized - raw).norm().item() / norm if norm > 0 else 0.0


def stored_weight_bytes(export_dir: str, names: set[str]) -> int:
    """Bytes the export spends on the weights (codes and scales) of the modules ``names``, read from the safetensors headers."""
    from safetensors import safe_open

    total = 0
    for f in sorted(n for n in os.listdir(export_dir) if n.endswith(".safetensors")):
        with safe_open(os.path.join(export_dir, f), "pt") as sf:
            for key in sf.keys():
                mod, _, local = key.rpartition(".")
                if mod in names and local not in _NOT_WEIGHT:
                    s = sf.get_slice(key)
                    n = 1
                    for d in s.get_shape():
                        n *= d
                    total += n * torch.empty((), dtype=_DTYPES[s.get_dtype()]).element_size()
    return total


_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}


def _mb(n: int) -> str:
    return f"{n / 1e6:.2f} MB"


def summary_rows(report: dict) -> list[tuple[str, str]]:
    """(item, value) rows of the final table."""
    ppl = report["perplexity"]
    rows = [
        ("model", report["model"]),
        ("recipe / algorithm", f"{report['recipe']} / {report['algorithm']}"),
        (
            "calibration",
            f"{report['data']['calib_windows']} x {report['data']['seq_len']} tokens of {report['data']['source']}"
            + (", layer by layer" if report["sequential"] else ""),
        ),
    ]
    for label, n in sorted(report["modules"]["quantized"].items()):
        rows.append((f"quantized: {label}", f"{n} weights"))
    skipped = report["modules"]["skipped"]
    rows.append(("left unquantized", f"{len(skipped)} modules: {', '.join(skipped)}"))
    cov = report["coverage"]
    rows.append(
        (
            "weight coverage",
            f"{cov['quantized_share']:.1%} of {cov['total']} GEMM weight elements ({cov['silent_share']:.1%} unquantized unasked)",
        )
    )
    if report["effective_bits"] is not None:
        rows.append(("effective bits", f"{report['effective_bits']:.3f} per quantized weight element (codes and scales)"))
    size = report["size_bytes"]
    rows.append(
        (
            "model size",
            f"{_mb(size['before'])} -> {_mb(size['after'])}" if size["after"] is not None else f"{_mb(size['before'])} (not exported)",
        )
    )
    for key in ("before", "after", "reloaded"):
        if ppl.get(key):
            rows.append(
                (f"perplexity {key}", f"{ppl[key]['perplexity']:.4f} ± {ppl[key]['stderr']:.2g} ({ppl[key]['windows']} held-out windows)")
            )
    chk = report["check"]
    rows.append(("reload check", chk["summary"]))
    rows.append(("export", f"{report['export']['dir']} ({report['export']['format']})"))
    rows.append(
        (
            "wall time",
            ", ".join(f"{k} {v:.1f} s" for k, v in report["stage_seconds"].items())
            + f"; total {sum(report['stage_seconds'].values()):.1f} s",
        )
    )
    return rows


#: longest value of a row of the printed table (report.json keeps everything)
_MAX_VALUE = 110


def format_table(rows: list[tuple[str, str]]) -> str:
    rows = [(k, v if len(v) <= _MAX_VALUE else v[: _MAX_VALUE - 3] + "...") for k, v in rows]
    width = max(len(k) for k, _ in rows)
    line = "-" * (width + 2 + max(len(v) for _, v in rows))
    return "\n".join([line] + [f"{k.ljust(width)}  {v}" for k, v in rows] + [line])


def _svg(errors: list[dict]) -> str:
    """A horizontal bar per module: its relative weight error."""
    if not errors:
        return "<p>No quantized weights.</p>"
    bar_h, label_w, chart_w = 14, 360, 420
    top = max(e["rel_error"] for e in errors) or 1.0
    height = bar_h * len(errors) + 30
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{label_w + chart_w + 90}" height="{height}" font-family="monospace" '
        'font-size="11">'
    ]
    for i, e in enumerate(errors):
        y = i * bar_h + 4
        w = chart_w * e["rel_error"] / top
        parts.append(f'<text x="{label_w - 6}" y="{y + 10}" text-anchor="end">{html.escape(e["module"])}</text>')
        parts.append(
            f'<rect x="{label_w}" y="{y}" width="{w:.1f}" height="{bar_h - 3}" fill="#4878a8"><title>{e["rel_error"]:.4%}</title></rect>'
        )
        parts.append(f'<text x="{label_w + w + 4:.1f}" y="{y + 10}">{e["rel_error"]:.3%}</text>')
    parts.append(f'<text x="{label_w}" y="{height - 6}">relative weight error ||W_q - W|| / ||W|| per module (max {top:.3%})</text></svg>')
    return "\n".join(parts)


def write_reports(report: dict, out_dir: str) -> list[str]:
    """``report.json`` and ``report.html`` in ``out_dir``; returns their names."""
    with open(os.path.join(out_dir, "report.json"), "w") as f:
        json.dump(report, f, indent=2)
        f.write("\n")
    rows = "\n".join(f"<tr><th>{html.escape(k)}</th><td>{html.escape(v)}</td></tr>" for k, v in summary_rows(report))
    page = f"""<!doctype html>
<html><head><meta charset="utf-8"><title>quantlib quantize: {html.escape(report["recipe"])}</title>
<style>body{{font-family:sans-serif;margin:2em}} th{{text-align:left;padding-right:1em;vertical-align:top}}
td{{font-family:monospace}}</style></head>
<body><h1>quantlib quantize</h1>
<table>{rows}</table>
<h2>Quantization error per module</h2>
{_svg(report["layer_errors"])}
</body></html>
"""
    with open(os.path.join(out_dir, "report.html"), "w") as f:
        f.write(page)
    return ["report.json", "report.html"]


def versions() -> dict[str, Any]:
    import torch as _torch

    from .. import __version__

    out = {"quantlib": __version__, "torch": _torch.__version__}
    try:
        import transformers

        out["transformers"] = transformers.__version__
    except ImportError:
        pass
    return out
