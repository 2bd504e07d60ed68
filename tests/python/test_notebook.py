"""docs/quickstart.ipynb runs from top to bottom, and shows the replay's own figures."""
import pathlib

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")
pytest.importorskip("matplotlib")

from gpumem import _C  # noqa: E402
from gpumem.trace import replay  # noqa: E402

DOCS = pathlib.Path(__file__).resolve().parents[2] / "docs"
NOTEBOOK = DOCS / "quickstart.ipynb"
SNAPSHOT = pathlib.Path(__file__).resolve().parent / "data" / "gpt_adamw.pickle"
REPLAY_TITLE = "gpumem replay on the simulated device"


def outputs(notebook, mime: str) -> list[str]:
    return [output["data"][mime] for cell in notebook.cells if cell.cell_type == "code"
            for output in cell.outputs if mime in output.get("data", {})]


def replay_html(notebook) -> str:
    [html] = [text for text in outputs(notebook, "text/html") if REPLAY_TITLE in text]
    return html


@pytest.fixture(scope="module")
def executed():
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    client = nbclient.NotebookClient(notebook, timeout=600, kernel_name="python3",
                                     resources={"metadata": {"path": str(DOCS)}})
    client.execute()  # raises CellExecutionError, naming the cell, if one fails
    return notebook


def test_the_notebook_runs_without_an_error(executed):
    kinds = {output.output_type for cell in executed.cells if cell.cell_type == "code" for output in cell.outputs}
    assert "error" not in kinds


def test_the_replay_report_shows_the_limit_and_the_replays_allocated_and_reserved_bytes(executed):
    result = replay.replay(SNAPSHOT, "3GB")
    html = replay_html(executed)
    figures = [result.limit, result.stats["allocated_bytes.all.current"], result.stats["allocated_bytes.all.peak"],
               result.stats["reserved_bytes.all.current"], result.stats["reserved_bytes.all.peak"]]
    for nbytes in figures:
        assert _C.format_bytes(nbytes) in html


def test_the_plot_is_drawn_inline(executed):
    assert outputs(executed, "image/png")


def test_the_committed_notebook_carries_its_outputs():
    # Read on a code host, the notebook shows the report and the plot without being run.
    committed = nbformat.read(NOTEBOOK, as_version=4)
    assert replay_html(committed) and outputs(committed, "image/png")


def test_the_committed_outputs_are_those_of_a_fresh_run(executed):
    # The replay cells give the same figures on any machine: stored ones that differ are stale
    # (run it with nbclient from docs/ and save it, as the `executed` fixture does).
    committed = nbformat.read(NOTEBOOK, as_version=4)
    assert replay_html(committed) == replay_html(executed)
    assert stream_texts(committed)[-2:] == stream_texts(executed)[-2:]


def stream_texts(notebook) -> list[str]:
    return [output["text"] for cell in notebook.cells if cell.cell_type == "code"
            for output in cell.outputs if output.output_type == "stream" and output.get("name") == "stdout"]
