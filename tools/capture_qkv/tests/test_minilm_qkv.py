"""minilm_qkv.py on a tiny seeded random BERT written at test time (no download, no real weights):
the safetensors reader, the WordPiece tokenizer, the forward pass against a plain per-token loop,
and the .npy files main() writes."""
import json
import math
import pathlib
import struct
import subprocess
import sys

import numpy as np
import pytest

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
import minilm_qkv  # noqa: E402

HIDDEN, HEADS, INTER, LAYERS, POSITIONS = 8, 2, 16, 2, 512
VOCAB = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "hello", "##s", "world", ",", "un", "##aff", "##able"]
# Sums in float64 here against float32 there, erf's approximation (< 1.5e-7) inside GELU.
TOLERANCE = 2e-4


def write_safetensors(path, tensors):
    header, blobs, offset = {"__metadata__": {"format": "pt"}}, [], 0
    for name, array in tensors.items():
        raw = np.ascontiguousarray(array).tobytes()
        header[name] = {"dtype": "F32" if array.dtype == np.float32 else "I64", "shape": list(array.shape),
                        "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + b"".join(blobs))


def tiny_bert(seed=7):
    rng = np.random.default_rng(seed)

    def r(*shape, scale=0.5):
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    t = {"embeddings.word_embeddings.weight": r(len(VOCAB), HIDDEN),
         "embeddings.position_embeddings.weight": r(POSITIONS, HIDDEN),
         "embeddings.token_type_embeddings.weight": r(2, HIDDEN),
         "embeddings.LayerNorm.weight": 1 + r(HIDDEN, scale=0.1), "embeddings.LayerNorm.bias": r(HIDDEN, scale=0.1),
         "embeddings.position_ids": np.arange(POSITIONS, dtype=np.int64)[None]}
    for layer in range(LAYERS):
        p = f"encoder.layer.{layer}."
        for name in ("query", "key", "value"):
            t[p + f"attention.self.{name}.weight"] = r(HIDDEN, HIDDEN)
            t[p + f"attention.self.{name}.bias"] = r(HIDDEN, scale=0.1)
        t[p + "attention.output.dense.weight"], t[p + "attention.output.dense.bias"] = r(HIDDEN, HIDDEN), r(HIDDEN)
        t[p + "attention.output.LayerNorm.weight"] = 1 + r(HIDDEN, scale=0.1)
        t[p + "attention.output.LayerNorm.bias"] = r(HIDDEN, scale=0.1)
        t[p + "intermediate.dense.weight"], t[p + "intermediate.dense.bias"] = r(INTER, HIDDEN), r(INTER)
        t[p + "output.dense.weight"], t[p + "output.dense.bias"] = r(HIDDEN, INTER), r(HIDDEN)
        t[p + "output.LayerNorm.weight"] = 1 + r(HIDDEN, scale=0.1)
        t[p + "output.LayerNorm.bias"] = r(HIDDEN, scale=0.1)
    return t


@pytest.fixture
def model(tmp_path):
    t = tiny_bert()
    write_safetensors(tmp_path / "model.safetensors", t)
    (tmp_path / "vocab.txt").write_text("\n".join(VOCAB) + "\n")
    (tmp_path / "config.json").write_text(json.dumps({"num_attention_heads": HEADS}))
    return tmp_path, t


def reference_forward(t, ids):
    """BertModel written out token by token in float64 with math.erf: what forward() must compute."""
    def linear(x, name):
        return [sum(t[name + ".weight"][o][i] * x[i] for i in range(len(x))) + t[name + ".bias"][o]
                for o in range(t[name + ".weight"].shape[0])]

    def norm(x, name):
        m = sum(x) / len(x)
        v = sum((a - m) ** 2 for a in x) / len(x)
        return [(a - m) / math.sqrt(v + 1e-12) * t[name + ".weight"][i] + t[name + ".bias"][i] for i, a in enumerate(x)]

    e = t["embeddings.word_embeddings.weight"]
    h = [norm([float(e[tok][c] + t["embeddings.position_embeddings.weight"][i][c] +
                     t["embeddings.token_type_embeddings.weight"][0][c]) for c in range(HIDDEN)], "embeddings.LayerNorm")
         for i, tok in enumerate(ids)]
    d = HIDDEN // HEADS
    captured = []
    for layer in range(LAYERS):
        p = f"encoder.layer.{layer}."
        q, k, v = ([linear(x, p + f"attention.self.{n}") for x in h] for n in ("query", "key", "value"))
        captured.append((q, k, v))
        ctx = []
        for i in range(len(ids)):
            row = []
            for hh in range(HEADS):
                s = [sum(q[i][hh * d + c] * k[j][hh * d + c] for c in range(d)) / math.sqrt(d) for j in range(len(ids))]
                m = max(s)
                w = [math.exp(a - m) for a in s]
                row += [sum(w[j] * v[j][hh * d + c] for j in range(len(ids))) / sum(w) for c in range(d)]
            ctx.append(row)
        h = [norm([a + b for a, b in zip(x, linear(c, p + "attention.output.dense"))], p + "attention.output.LayerNorm")
             for x, c in zip(h, ctx)]
        f = [[0.5 * a * (1 + math.erf(a / math.sqrt(2))) for a in linear(x, p + "intermediate.dense")] for x in h]
        h = [norm([a + b for a, b in zip(x, linear(y, p + "output.dense"))], p + "output.LayerNorm") for x, y in zip(h, f)]
    return np.array(h), captured


def test_safetensors_reader_keeps_float32_and_skips_others(model):
    folder, t = model
    read = minilm_qkv.read_safetensors(folder / "model.safetensors")
    assert "embeddings.position_ids" not in read  # I64
    assert set(read) == {k for k in t if k != "embeddings.position_ids"}
    for name, array in read.items():
        np.testing.assert_array_equal(array, t[name])


def test_wordpiece_lowercases_strips_accents_splits_punctuation(model):
    folder, _ = model
    tok = minilm_qkv.WordPiece(folder / "vocab.txt")
    ids = tok.encode("Héllos, unaffable WORLD!")
    assert [VOCAB[i] for i in ids] == ["hello", "##s", ",", "un", "##aff", "##able", "world", "[UNK]"]


def test_forward_matches_a_per_token_loop(model):
    _, t = model
    ids = [2, 4, 5, 7, 8, 9, 10, 6, 3]
    hidden, captured = minilm_qkv.forward(t, ids, heads=HEADS)
    want_hidden, want = reference_forward(t, ids)
    np.testing.assert_allclose(hidden, want_hidden, atol=TOLERANCE, rtol=TOLERANCE)
    assert len(captured) == LAYERS
    for (q, k, v), (wq, wk, wv) in zip(captured, want):
        for got, ref in ((q, wq), (k, wk), (v, wv)):
            assert got.shape == (len(ids), HEADS, HIDDEN // HEADS) and got.dtype == np.float32
            np.testing.assert_allclose(got.reshape(len(ids), HIDDEN), np.array(ref), atol=TOLERANCE, rtol=TOLERANCE)


def test_main_writes_each_layers_qkv_of_512_tokens(model, tmp_path):
    folder, t = model
    text = tmp_path / "text.txt"
    text.write_text("hellos, world " * 200)  # 4 word pieces each: 800 ≥ one chunk of 510
    out = tmp_path / "qkv"
    subprocess.run([sys.executable, str(HERE.parent / "minilm_qkv.py"), "--model", str(folder), "--text", str(text),
                    "--out", str(out)], check=True, capture_output=True)
    tok = minilm_qkv.WordPiece(folder / "vocab.txt")
    ids = [2] + tok.encode(text.read_text())[:510] + [3]
    _, captured = minilm_qkv.forward(t, ids, heads=HEADS)
    for layer in range(LAYERS):
        for name, want in zip("qkv", captured[layer]):
            got = np.load(out / f"chunk0_layer{layer}_{name}.npy")
            assert got.shape == (512, HEADS, HIDDEN // HEADS) and got.dtype == np.float32
            np.testing.assert_array_equal(got, want)
    too_many = subprocess.run([sys.executable, str(HERE.parent / "minilm_qkv.py"), "--model", str(folder), "--text",
                               str(text), "--out", str(out), "--chunks", "2"], capture_output=True, text=True)
    assert too_many.returncode != 0 and "fewer than 2 chunks" in too_many.stderr
