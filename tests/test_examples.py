"""The examples run top to bottom: examples/quickstart.py and examples/quickstart.ipynb."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"


def _env() -> dict:
    # the checkout's package, also where it is not installed
    path = os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH"))))
    return dict(os.environ, PYTHONPATH=path)


def test_quickstart_script():
    res = subprocess.run([sys.executable, str(EXAMPLES / "quickstart.py")], cwd=ROOT,
                         env=_env(), capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "op calls run on:" in res.stdout and "kernel variants" in res.stdout
    assert "OUTSIDE" not in res.stdout
    assert "PatchReport: " in res.stdout and "greedy tokens, unpatched:" in res.stdout


def test_quickstart_notebook(monkeypatch):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    pytest.importorskip("ipykernel")
    for key, value in _env().items():
        monkeypatch.setenv(key, value)  # the kernel process inherits them
    nb = nbformat.read(EXAMPLES / "quickstart.ipynb", as_version=4)
    nbclient.NotebookClient(nb, timeout=900, kernel_name="python3",
                            resources={"metadata": {"path": str(EXAMPLES)}}).execute()
    outputs = [o for cell in nb.cells if cell.cell_type == "code" for o in cell.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    html = "".join(o.get("data", {}).get("text/html", "") for o in outputs)
    assert "<table>" in html and "gated_rms_norm_row" in html  # the registry as a table
    assert "<p>PatchReport: " in html  # the patched model's report as a table
