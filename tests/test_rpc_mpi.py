"""distlab.rpc over MPI: the agent and the RRef protocol on 2, 3 and 4 workers, each twin and a mixed world."""
import pytest

pytestmark = pytest.mark.mpi


@pytest.mark.parametrize("np_", [2, 3])
def test_agent(mpirun, np_):
    result = mpirun("rpc_agent.py", np=np_, timeout=120)
    assert result.stdout.count("rpc agent OK") == np_


def test_torch_rpc_api(mpirun, impl):
    # worker infos, get/_set_rpc_timeout, functions.async_execution, proxies that check the method at the call,
    # RRef.backward (local and distributed)
    result = mpirun("rpc_api.py", np=2, timeout=120, env={"DISTLAB_IMPL": impl, "DISTLAB_TIMEOUT": "77"})
    assert result.stdout.count("rpc api OK") == 2


def test_malformed_messages_are_refused_and_answered(mpirun, impl):
    # each twin of the wire codec refuses them, and a refused message has none of its pickles loaded
    result = mpirun("rpc_malformed.py", np=2, timeout=120,
                    env={"DISTLAB_RPC_MAX_MESSAGE_BYTES": "4000000", "DISTLAB_IMPL": impl})
    assert result.stdout.count("rpc malformed OK") == 2


def test_agent_mixed_world(mpirun):
    result = mpirun("rpc_agent.py", np=2, args=["mixed"], timeout=120)
    assert result.stdout.count("rpc agent OK") == 2


@pytest.mark.parametrize("np_", [2, 3, 4])
def test_rrefs_every_fork_case(mpirun, impl, np_):
    result = mpirun("rpc_rref.py", np=np_, timeout=120, env={"DISTLAB_IMPL": impl})
    assert result.stdout.count(f"impl {impl}") == np_


@pytest.mark.parametrize("np_", [2, 4])
def test_rrefs_mixed_world(mpirun, np_):
    result = mpirun("rpc_rref.py", np=np_, args=["mixed"], timeout=120)
    assert result.stdout.count("impl reference") == (np_ + 1) // 2
    assert result.stdout.count("impl core") == np_ // 2


def test_parameter_server_example(mpirun):
    from pathlib import Path

    example = Path(__file__).resolve().parent.parent / "examples" / "parameter_server.py"
    result = mpirun(str(example), np=3, timeout=120)
    assert "parameter server example OK" in result.stdout


def test_lifecycle_and_timeline(mpirun, tmp_path):
    import json

    path = tmp_path / "rpc_timeline.json"
    result = mpirun("rpc_lifecycle.py", np=2, timeout=120, timeline=str(path))
    assert result.stdout.count("rpc lifecycle OK") == 2
    events = json.loads(path.read_text())
    events = events["traceEvents"] if isinstance(events, dict) else events
    names = {e.get("name", "") for e in events}
    assert any(n.startswith("rpc call -> w1") for n in names), sorted(names)[:20]
    assert any(n.startswith("handle call <- w0") for n in names)
