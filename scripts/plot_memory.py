#!/usr/bin/env python3
"""Plots peak VRAM against sequence length for PyTorch and each kvpack K/V format.

    scripts/plot_memory.py                                  # bench/RESULTS.md -> docs/peak_vram.png
    scripts/plot_memory.py -i results.json -o out.png --card "RTX 4070 (12 GiB)=12"

Input, either of:

* Markdown (bench/RESULTS.md, as the CUDA benchmark writes it): every pipe table with an `impl`
  column, a token count and a peak column contributes its rows; other tables and columns are
  ignored. Header names are matched case-insensitively.
  - tokens: a `tokens` column, or a `shape` column such as `N=152263 56×128` (N tokens, then
    heads×head_dim, which is kept as the row's shape);
  - format: a `format` column, or the words after the first in `impl` (`kvpack int4 in place` is
    impl `kvpack`, format `int4 in place`; `torch cudnn` is impl `pytorch-cudnn`);
  - peak: `peak_bytes` (bytes) or `peak_gib` / `peak GiB` (GiB).
  Cells may use `_` or `,` as digit separators and may be wrapped in backticks. RESULTS.md lists
  the newest run first: of rows with the same impl, format, shape and tokens the first is kept.
* JSON: a list of rows, or {"rows": [...]}, each {"impl", "format", "tokens", "peak_bytes"} and
  optionally "shape".

`impl` names the implementation: `pytorch-cudnn`, `pytorch-fa2` (`torch flash`),
`pytorch-efficient`, `kvpack` (others are plotted under their own name). `format` is the K/V format
of kvpack rows (`int4`, `int8`, `bf16`, `int4 in place`, ...); PyTorch rows give `bf16` or `-`. A
peak that is not a number (`OOM`, `crash`, `-`) marks a size the implementation failed at: it is
drawn as a cross on the top edge of the plot. One line per (impl, format); points are sorted by
tokens. Rows of several shapes: only one is plotted, `--shape` or else the most frequent.
"""

import argparse
import json
import math
import pathlib
import re
import sys

REPO = pathlib.Path(__file__).resolve().parents[1]
GIB = 1 << 30

LABELS = {"pytorch-cudnn": "PyTorch x@W + SDPA (cuDNN)",
          "pytorch-fa2": "PyTorch x@W + SDPA (FlashAttention-2)",
          "pytorch-flash": "PyTorch x@W + SDPA (FlashAttention-2)",
          "pytorch-efficient": "PyTorch x@W + SDPA (memory-efficient)"}


class InputError(ValueError):
    pass


def _number(cell):
    cell = cell.strip().strip("`").replace("_", "").replace(",", "")
    try:
        return float(cell)
    except ValueError:
        return None


def _norm(header):
    return re.sub(r"[^a-z0-9]+", "_", header.strip().strip("`").lower()).strip("_")


TORCH_BACKENDS = {"cudnn": "pytorch-cudnn", "flash": "pytorch-fa2", "fa2": "pytorch-fa2",
                  "efficient": "pytorch-efficient", "mem_efficient": "pytorch-efficient"}


def _split_impl(impl, fmt):
    """(impl, format) from an impl cell that may carry the format or backend after a space."""
    words = impl.split()
    if fmt is not None or len(words) < 2:
        return impl, fmt if fmt is not None else "-"
    head, rest = words[0].lower(), " ".join(words[1:])
    if head in ("torch", "pytorch"):
        return TORCH_BACKENDS.get(rest.lower(), f"pytorch-{rest.lower()}"), "bf16"
    return words[0], rest


def _shape_tokens(cell):
    """'N=152263 56×128' -> (152263, '56x128')."""
    m = re.search(r"N\s*=\s*([\d_,]+)", cell)
    tokens = _number(m.group(1)) if m else None
    shape = re.sub(r"N\s*=\s*[\d_,]+", "", cell).strip().replace("×", "x") or "-"
    return tokens, shape


def parse_markdown(text):
    rows, header, seen = [], None, set()
    for line in text.splitlines() + [""]:
        line = line.strip()
        if not line.startswith("|"):
            header = None
            continue
        cells = [c.strip() for c in line.strip("|").split("|")]
        if header is None:
            header = [_norm(c) for c in cells]
            continue
        if all(re.fullmatch(r":?-{2,}:?", c) for c in cells):
            continue
        rec = {k: v.strip("`") for k, v in zip(header, cells)}
        peak_key = next((k for k in ("peak_bytes", "peak_gib") if k in rec), None)
        if "impl" not in rec or peak_key is None or not ({"tokens", "shape"} & rec.keys()):
            continue
        peak = _number(rec[peak_key])
        if peak is not None and peak_key == "peak_gib":
            peak *= GIB
        if "tokens" in rec:
            tokens, shape = _number(rec["tokens"]), rec.get("shape", "-")
        else:
            tokens, shape = _shape_tokens(rec["shape"])
        impl, fmt = _split_impl(rec["impl"], rec.get("format"))
        key = (impl, fmt, shape, tokens)
        if key in seen:
            continue            # an older run of the same configuration
        seen.add(key)
        rows.append({"impl": impl, "format": fmt, "tokens": tokens, "peak_bytes": peak,
                     "shape": shape})
    return rows


def parse_json(text):
    data = json.loads(text)
    if isinstance(data, dict):
        data = data.get("rows")
    if not isinstance(data, list):
        raise InputError('JSON input must be a list of rows or {"rows": [...]}')
    rows = []
    for i, r in enumerate(data):
        missing = {"impl", "format", "tokens", "peak_bytes"} - set(r)
        if missing:
            raise InputError(f"row {i} lacks {sorted(missing)}")
        peak = r["peak_bytes"]
        rows.append({"impl": str(r["impl"]), "format": str(r["format"]),
                     "tokens": _number(str(r["tokens"])),
                     "peak_bytes": peak if isinstance(peak, (int, float)) else _number(str(peak)),
                     "shape": str(r.get("shape", "-"))})
    return rows


def select_shape(rows, shape=None):
    """The rows of one shape: `shape` (e.g. '56x128'), or the most frequent one."""
    shapes = [r["shape"] for r in rows]
    if shape is None:
        shape = max(sorted(set(shapes)), key=shapes.count)
    picked = [r for r in rows if r["shape"] == shape.replace("×", "x")]
    if not picked:
        raise InputError(f"no rows of shape {shape}; shapes: {sorted(set(shapes))}")
    return picked, shape


def load(path):
    path = pathlib.Path(path)
    text = path.read_text()
    rows = parse_json(text) if path.suffix == ".json" else parse_markdown(text)
    rows = [r for r in rows if r["tokens"] is not None]
    if not rows:
        raise InputError(f"{path}: no rows with impl, format, tokens and a peak column")
    return rows


def series(rows):
    """{label: ([tokens], [peak GiB or None])}, PyTorch first, then kvpack formats."""
    out = {}
    for r in sorted(rows, key=lambda r: r["tokens"]):
        impl = r["impl"].lower()
        if impl.startswith("pytorch") or impl.startswith("torch"):
            label = LABELS.get(impl, r["impl"])
        else:
            words = r["format"].split() if r["format"] not in ("", "-") else ["default"]
            label = " ".join([r["impl"], words[0].upper()]) + \
                (f", {' '.join(words[1:])}" if len(words) > 1 else "")
        xs, ys = out.setdefault(label, ([], []))
        xs.append(r["tokens"])
        ys.append(r["peak_bytes"] / GIB if r["peak_bytes"] is not None else None)
    return dict(sorted(out.items(), key=lambda kv: (not kv[0].startswith("PyTorch"), kv[0])))


def plot(rows, output, cards=(), title=None, logy=False):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = series(rows)
    fig, ax = plt.subplots(figsize=(9, 5.5), dpi=120)
    peaks = [y for _, ys in data.values() for y in ys if y is not None]
    top = max(peaks + [c for _, c in cards] + [1.0]) * 1.12
    for i, (label, (xs, ys)) in enumerate(data.items()):
        style = "--" if label.startswith("PyTorch") else "-"
        ok = [(x, y) for x, y in zip(xs, ys) if y is not None]
        line = ax.plot([x for x, _ in ok], [y for _, y in ok], style, marker="o", markersize=4,
                       label=label)[0]
        failed = [x for x, y in zip(xs, ys) if y is None]
        if failed:
            ax.plot(failed, [top] * len(failed), "x", color=line.get_color(), markersize=9,
                    clip_on=False)
    for name, gib in cards:
        ax.axhline(gib, color="grey", linewidth=0.8, linestyle=":")
        ax.text(0.99, gib, f"{name} ", transform=ax.get_yaxis_transform(), ha="right",
                va="bottom", fontsize=8, color="grey")
    ax.set_xscale("log", base=2)
    if logy:
        ax.set_yscale("log")
        ax.set_ylim(min(peaks + [top]) / 2, top)
    else:
        ax.set_ylim(0, top)
    ax.set_xlabel("tokens in the sequence")
    ax.set_ylabel("peak VRAM above inputs (GiB)")
    ax.set_title(title or "Peak VRAM of one attention layer (QKV projection + attention)")
    ax.grid(True, which="both", alpha=0.3)
    if any(None in ys for _, ys in data.values()):
        ax.plot([], [], "x", color="black", label="failed (OOM / crash)")
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    pathlib.Path(output).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(output)
    plt.close(fig)


def parse_card(text):
    name, sep, gib = text.rpartition("=")
    if not sep or not name or _number(gib) is None or math.isnan(_number(gib)):
        raise argparse.ArgumentTypeError(f"--card wants NAME=GIB, got {text!r}")
    return name, _number(gib)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="\n".join(__doc__.splitlines()[5:]))
    ap.add_argument("-i", "--input", default=str(REPO / "bench" / "RESULTS.md"))
    ap.add_argument("-o", "--output", default=str(REPO / "docs" / "peak_vram.png"))
    ap.add_argument("--card", type=parse_card, action="append", default=[],
                    help="a horizontal line for a GPU's memory, NAME=GIB (repeatable)")
    ap.add_argument("--title")
    ap.add_argument("--logy", action="store_true", help="logarithmic memory axis")
    ap.add_argument("--shape", help="heads x head_dim to plot, e.g. 56x128 (default: most rows)")
    args = ap.parse_args(argv)
    try:
        rows, shape = select_shape(load(args.input), args.shape)
    except (OSError, InputError, json.JSONDecodeError) as e:
        print(f"plot_memory: {e}", file=sys.stderr)
        return 2
    title = args.title
    if title is None and shape != "-":
        h, _, d = shape.partition("x")
        title = f"Peak VRAM of one attention layer above its inputs ({h} heads × {d})"
    plot(rows, args.output, args.card, title, args.logy)
    print(f"plot_memory: {len(rows)} rows -> {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
