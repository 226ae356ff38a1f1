"""A two-node launch, tested on one machine: two torchrun agents, each ``--nnodes 2 --nproc-per-node 2`` with a
c10d rendezvous on one endpoint, as two machines run them (``tests/multinode_program.py`` is each rank's program).

* The 2x2 job at stage 3 equals eager PyTorch on the global batch in one process (the bound of
  ``test_zero_parity``: ten times what reduction order alone moves the results on this machine, never below
  1e-6), and every rank saw ``WORLD_SIZE=4``, ``LOCAL_WORLD_SIZE=2`` and its node's ``GROUP_RANK``.
* A node dying mid-training (its agent and its workers killed with SIGKILL) ends every rank of the other node
  with zgraph's named error within ``Config.collective_timeout`` plus a margin, and that node's agent exits
  non-zero.

Every agent runs in a session of its own under a deadline; at the deadline the test kills the agents and their
workers (torchrun starts each worker in a session of its own) and fails with the agents' output.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid

import pytest
import torch
from dist_harness import free_port
from multinode_program import COLLECTIVE_TIMEOUT
from test_zero_parity import assert_rel, expected
from zero_cases import CASES

TESTS = os.path.dirname(os.path.abspath(__file__))
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]  # the torchrun command, whatever the PATH
NODES, PER_NODE = 2, 2
DEADLINE = 120.0  # seconds a whole launch may take (torchrun's start-up is a few seconds on two cores)
MARGIN = 10.0  # seconds past the collective timeout a surviving rank may take to raise


def _launch(mode: str, out, agents: list[subprocess.Popen]) -> list[subprocess.Popen]:
    """Start the two agents of one job, appended to ``agents`` as they start (``out``: where the ranks write, and
    each agent's log). The second starts once the first serves the rendezvous's store on the endpoint, so the
    first agent is the rendezvous's host and, the lower pid on one machine, the node of ``GROUP_RANK`` 0, whose
    agent serves the workers' store too."""
    port = free_port()
    endpoint, job = f"127.0.0.1:{port}", f"zgraph-{uuid.uuid4().hex[:12]}"
    path = os.pathsep.join(p for p in (TESTS, os.environ.get("PYTHONPATH")) if p)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=path)
    command = [*TORCHRUN, f"--nnodes={NODES}", f"--nproc-per-node={PER_NODE}", "--rdzv-backend=c10d"]
    command += [f"--rdzv-endpoint={endpoint}", f"--rdzv-id={job}", os.path.join(TESTS, "multinode_program.py")]
    for node in range(NODES):
        with open(out / f"agent{node}.log", "w") as log:
            agent = subprocess.Popen(
                [*command, mode, str(out)], stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        agents.append(agent)
        deadline = time.monotonic() + 30
        while node == 0 and not _listening(port):
            if time.monotonic() > deadline or agent.poll() is not None:
                _wait(agents, out, time.monotonic())
                pytest.fail(f"the first agent did not serve the rendezvous's store:\n{_logs(out)}")
            time.sleep(0.05)
    return agents


def _listening(port: int) -> bool:
    """Whether a process of this machine listens on TCP ``port`` (read from /proc: nothing connects to it)."""
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            rows = [line.split() for line in f.readlines()[1:]]
        if any(int(row[1].rsplit(":", 1)[1], 16) == port and row[3] == "0A" for row in rows):
            return True
    return False


def _ranks(out) -> dict[int, dict]:
    """What each rank that started wrote about itself (``multinode_program``'s ``env.<rank>.json``)."""
    found = {}
    for name in os.listdir(out):
        if name.startswith("env.") and name.endswith(".json"):
            with open(out / name) as f:
                found[int(name.split(".")[1])] = json.load(f)
    return found


def _kill(agent: subprocess.Popen, out) -> None:
    """Kill ``agent`` (its process group) and the workers it started: a node dying at once. Only processes still
    running this job's program are signalled (a pid that ended may have been reused)."""
    for pid in [r["pid"] for r in _ranks(out).values() if r["agent"] == agent.pid]:
        if _runs_program(pid, out):
            os.kill(pid, signal.SIGKILL)
    if agent.poll() is None:
        os.killpg(agent.pid, signal.SIGKILL)


def _runs_program(pid: int, out) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return str(out).encode() in f.read().split(b"\0")
    except (FileNotFoundError, ProcessLookupError):
        return False


@pytest.fixture
def launch(tmp_path):
    """``launch(mode)`` starts a job's two agents (``_launch``); whatever of it still runs when the test ends,
    passed or failed, is killed."""
    started: list[subprocess.Popen] = []

    def start(mode: str) -> list[subprocess.Popen]:
        return _launch(mode, tmp_path, started)

    yield start
    for agent in started:
        _kill(agent, tmp_path)
        agent.wait()


def _logs(out) -> str:
    return "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted(out.glob("agent*.log")))


def _wait(agents: list[subprocess.Popen], out, deadline: float) -> list[int]:
    """The agents' exit codes; at ``deadline`` (``time.monotonic()``) every agent and worker left is killed and
    the test fails with the agents' output."""
    try:
        return [agent.wait(timeout=max(0.0, deadline - time.monotonic())) for agent in agents]
    except subprocess.TimeoutExpired:
        for agent in agents:
            _kill(agent, out)
        for agent in agents:
            agent.wait()
        pytest.fail(f"the job did not end by its deadline (killed):\n{_logs(out)}")


def _check_nodes(ranks: dict[int, dict], agents: list[subprocess.Popen]) -> None:
    """Four ranks, two per node, each node's ranks started by one agent and named by its ``GROUP_RANK``."""
    assert sorted(ranks) == list(range(NODES * PER_NODE)), sorted(ranks)
    for rank, seen in ranks.items():
        assert seen["WORLD_SIZE"] == str(NODES * PER_NODE) and seen["LOCAL_WORLD_SIZE"] == str(PER_NODE), seen
        assert seen["GROUP_RANK"] == str(rank // PER_NODE) and seen["LOCAL_RANK"] == str(rank % PER_NODE), seen
    by_agent = {a.pid: sorted(r for r, seen in ranks.items() if seen["agent"] == a.pid) for a in agents}
    assert sorted(by_agent.values()) == [[0, 1], [2, 3]], by_agent


def test_two_agents_of_two_ranks_equal_eager_on_the_global_batch(tmp_path, launch):
    agents = launch("parity")
    codes = _wait(agents, tmp_path, time.monotonic() + DEADLINE)
    assert codes == [0, 0], _logs(tmp_path)
    _check_nodes(_ranks(tmp_path), agents)
    got = torch.load(tmp_path / "result.pt", weights_only=True)
    want, bound = expected("adamw", NODES * PER_NODE)
    assert len(got["losses"]) == len(want["losses"]) == CASES["adamw"].steps
    for i, (loss, eager) in enumerate(zip(got["losses"], want["losses"])):
        assert abs(loss - eager) <= bound * max(abs(eager), 1e-12), f"loss of step {i}: {loss} vs {eager} ({bound})"
    assert got["model"].keys() == want["models"][0].keys()
    for key, value in want["models"][0].items():
        assert_rel(got["model"][key], value, f"full_state_dict[{key!r}]", bound)


def _progress(out, rank: int) -> int:
    try:
        return int((out / f"progress.{rank}").read_text() or 0)
    except FileNotFoundError:
        return 0


def _kill_a_node_mid_training(launch, out, node: int) -> tuple[subprocess.Popen, dict[int, dict], float]:
    """Start the job, wait until every rank has finished steps, kill node ``node`` (its agent and workers);
    returns the other node's agent once it has exited, the ranks' records, and when the kill was (``time.time``)."""
    agents = launch("train")
    deadline = time.monotonic() + DEADLINE
    while min(_progress(out, r) for r in range(NODES * PER_NODE)) < 3:  # every rank is training
        if time.monotonic() > deadline or any(a.poll() is not None for a in agents):
            _wait(agents, out, time.monotonic())
            pytest.fail(f"the job did not start training:\n{_logs(out)}")
        time.sleep(0.1)
    ranks = _ranks(out)
    _check_nodes(ranks, agents)
    assert ranks[0]["agent"] == agents[0].pid, "the first agent started is not GROUP_RANK 0's"
    dead, survivor = agents[node], agents[1 - node]
    killed_at = time.time()
    _kill(dead, out)
    _wait([survivor], out, time.monotonic() + COLLECTIVE_TIMEOUT + MARGIN)
    dead.wait()
    return survivor, ranks, killed_at


def _outcome(out, rank: int) -> dict | None:
    path = out / f"outcome.{rank}.json"
    return json.loads(path.read_text()) if path.exists() else None


def test_a_node_dying_mid_training_ends_the_other_nodes_ranks_with_zgraphs_error(tmp_path, launch):
    # node 1 dies: it serves neither the rendezvous's store nor the workers', so node 0's agent waits on its
    # workers, and each of them meets the dead ranks in a collective of the step. The first to fail exits with
    # zgraph's error; torchrun's agent then ends the others (SIGTERM) unless they have failed too by then
    survivor, ranks, killed_at = _kill_a_node_mid_training(launch, tmp_path, node=1)
    assert survivor.returncode != 0, _logs(tmp_path)
    log = (tmp_path / "agent0.log").read_text()
    outcomes = {rank: _outcome(tmp_path, rank) for rank in (0, 1)}
    assert any(outcomes.values()), f"no rank wrote zgraph's error:\n{_logs(tmp_path)}"
    for rank, outcome in outcomes.items():
        terminated = f"Sending process {ranks[rank]['pid']} closing signal SIGTERM" in log
        assert terminated or outcome is not None, f"rank {rank}: no outcome, not ended by its agent:\n{log}"
        if outcome is not None:
            assert outcome["error"] in ("RankFailedError", "RankMismatchError"), outcome
            assert outcome["message"].startswith("zgraph:"), outcome
            assert outcome["at"] - killed_at < COLLECTIVE_TIMEOUT + MARGIN, outcome
        assert not _alive(ranks[rank]["pid"]), f"rank {rank} still running after its agent exited"


def test_the_node_serving_the_stores_dying_ends_the_other_nodes_ranks(tmp_path, launch):
    # node 0 dies, and with it the store the workers' group meets at and the rendezvous's, which the other agent
    # polls: that agent ends its workers (SIGTERM) and exits non-zero. A worker that meets the dead ranks in a
    # collective first raises zgraph's error, which says the store cannot be reached (seen every time here)
    survivor, ranks, killed_at = _kill_a_node_mid_training(launch, tmp_path, node=0)
    assert survivor.returncode != 0, _logs(tmp_path)
    log = (tmp_path / "agent1.log").read_text()
    for rank in (2, 3):
        outcome = _outcome(tmp_path, rank)
        terminated = f"Sending process {ranks[rank]['pid']} closing signal SIGTERM" in log
        assert terminated or outcome is not None, f"rank {rank}: no outcome, not ended by its agent:\n{log}"
        if outcome is not None:
            assert outcome["error"] in ("RankFailedError", "RankMismatchError"), outcome
            assert outcome["at"] - killed_at < COLLECTIVE_TIMEOUT + MARGIN, outcome
        assert not _alive(ranks[rank]["pid"]), f"rank {rank} still running after its agent exited"


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie does not), after giving a just-ended process a moment to be reaped."""
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return False
        except FileNotFoundError:
            return False
        time.sleep(0.1)
    return True
