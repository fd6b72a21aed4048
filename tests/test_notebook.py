"""The example notebook runs top to bottom (its code cells executed in order, in one namespace)."""

import json
import os

import matplotlib.figure
import pytest

pytestmark = pytest.mark.slow


def test_example_notebook_runs(tmp_path, monkeypatch):
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    notebook = json.load(open(os.path.join(repo, "notebooks", "example.ipynb")))
    monkeypatch.chdir(tmp_path)
    namespace = {"__name__": "__main__"}
    code = ["".join(cell["source"]) for cell in notebook["cells"] if cell["cell_type"] == "code"]
    code[0] = code[0].replace('Path("probes/gender.yaml")', f'Path({os.path.join(repo, "probes", "gender.yaml")!r})')
    for source in code:
        exec(compile(source, "example.ipynb", "exec"), namespace)
    assert namespace["run"].manifest["n_prompts"] == 150
    assert isinstance(namespace["fig"], matplotlib.figure.Figure)
    assert namespace["report"].is_file() and (tmp_path / "reports" / "notebook-example" / "head_stats.csv").is_file()
