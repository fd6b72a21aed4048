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
    assert "limit=150" in first.source
    first.source = first.source.replace("limit=150", "limit=40")  # each cell's code, on fewer prompts
    NotebookClient(
        notebook, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
    ).execute()
    errors = [o for cell in notebook.cells for o in cell.get("outputs", []) if o.output_type == "error"]
    assert not errors, errors
    plotting = [cell for cell in notebook.cells if cell.cell_type == "code" and "plot_heads" in cell.source]
    images = [sum("image/png" in o.get("data", {}) for o in cell.outputs) for cell in plotting]
    assert plotting and images == [1] * len(plotting), images  # each figure shown once, not twice
    matrix = next(cell for cell in notebook.cells if "attention_matrix" in cell.source)
    assert any("text/html" in o.get("data", {}) for o in matrix.outputs)  # one head's matrix, as a table
    assert (tmp_path / "head_stats_export.csv").is_file()
    assert (tmp_path / "reports" / "notebook-example" / "report.html").is_file()
    assert (tmp_path / "reports" / "notebook-example" / "head_stats.csv").is_file()


def test_the_example_notebook_is_committed_with_its_outputs():
    """A reader on GitHub sees what each cell gives without running it."""
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    notebook = nbformat.read(os.path.join(repo, "notebooks", "example.ipynb"), as_version=4)
    code = [cell for cell in notebook.cells if cell.cell_type == "code"]
    assert code and all(cell.outputs for cell in code)
    assert not [o for cell in code for o in cell.outputs if o.output_type == "error"]
