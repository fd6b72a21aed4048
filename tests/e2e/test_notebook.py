"""The example notebook, executed by a real Jupyter kernel (nbclient): every cell runs and every
plotting cell shows an image, as a user opening it in Jupyter would see."""

import os

import nbformat
import pytest
from nbclient import NotebookClient

pytestmark = pytest.mark.slow


def test_example_notebook_runs_in_a_kernel_and_shows_its_figures(tmp_path):
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    notebook = nbformat.read(os.path.join(repo, "notebooks", "example.ipynb"), as_version=4)
    first = notebook.cells[1]
    first.source = first.source.replace(
        'Path("probes/gender.yaml")', f"Path({os.path.join(repo, 'probes', 'gender.yaml')!r})"
    )
    NotebookClient(
        notebook, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
    ).execute()
    errors = [o for cell in notebook.cells for o in cell.get("outputs", []) if o.output_type == "error"]
    assert not errors, errors
    plotting = [cell for cell in notebook.cells if cell.cell_type == "code" and "plot_heads" in cell.source]
    assert plotting and all(any("image/png" in o.get("data", {}) for o in cell.outputs) for cell in plotting)
    assert (tmp_path / "reports" / "notebook-example" / "report.html").is_file()
    assert (tmp_path / "reports" / "notebook-example" / "head_stats.csv").is_file()
