import pathlib
import sys

# The package is importable from the source tree, without installing it.
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
