"""Every tutorial in tutorials/ executes from top to bottom, as a notebook, in a real Jupyter kernel.

The tutorials are jupytext percent-format ``.py`` files (``tutorials/NN_name.py``). Each is read with jupytext,
executed with nbclient in an ipykernel kernel running this interpreter, and fails the test with the failing
cell's source and traceback. The kernel works in a temporary directory (so the repository root is not on its
``sys.path``) with matplotlib's Agg backend. Tutorials start MPI jobs with ``distlab.run``.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TUTORIALS = sorted((REPO / "tutorials").glob("[0-9]*.py"))
CELL_TIMEOUT = 120  # seconds a single cell may run before it is interrupted (a tutorial takes seconds in total)
# Bounds every wait on the ranks, and so each distlab.run job (killed after DISTLAB_TIMEOUT + 60 s), below the cell
# timeout: a hang on the ranks then fails its cell with RankFailedError naming the rank, and leaves no job behind.
RANK_TIMEOUT = 30
ANSI = re.compile(r"\x1b\[[0-9;]*m")  # IPython colours its tracebacks; pytest shows plain text


def test_tutorials_exist():
    assert TUTORIALS, f"no tutorials found in {REPO / 'tutorials'}"


@pytest.mark.mpi
@pytest.mark.parametrize("path", TUTORIALS, ids=lambda p: p.stem)
def test_tutorial_executes(path, tmp_path, monkeypatch):
    import jupytext
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError, CellTimeoutError

    monkeypatch.setenv("MPLBACKEND", "Agg")
    monkeypatch.setenv("DISTLAB_TIMEOUT", str(RANK_TIMEOUT))
    notebook = jupytext.read(path, fmt="py:percent")
    assert any(cell.cell_type == "code" for cell in notebook.cells), f"{path.name} has no code cells"
    # interrupt_on_timeout: a KeyboardInterrupt in the kernel lets distlab.run kill its mpiexec job's process group.
    client = NotebookClient(notebook, timeout=CELL_TIMEOUT, startup_timeout=120, kernel_name="python3",
                            interrupt_on_timeout=True, resources={"metadata": {"path": str(tmp_path)}})
    try:
        client.execute()
    except CellTimeoutError as exc:
        pytest.fail(f"{path.name}: a cell ran longer than {CELL_TIMEOUT} s:\n{_plain(exc)}", pytrace=False)
    except CellExecutionError as exc:
        pytest.fail(f"{path.name}: a cell raised (a cell running longer than {CELL_TIMEOUT} s is interrupted, "
                    f"which shows as KeyboardInterrupt):\n{_plain(exc)}", pytrace=False)


def _plain(exc: BaseException) -> str:
    return ANSI.sub("", str(exc))
