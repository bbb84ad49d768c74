"""The local Slurm cluster of scripts/slurm-local.sh: jobs run, and sacct tells how they ended;
several nodes on one machine talk over their own (shaped) links, and node faults end jobs
NODE_FAIL."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from tests.slurm_cluster import SCRIPT, SlurmCluster, _free_port_base, slurm_cluster

pytestmark = pytest.mark.slurm


def sbatch(cluster: SlurmCluster, out: Path, *args: str) -> str:
    return cluster.run("sbatch", "--parsable", f"--output={out}", *args).strip()


def test_node_advertises_eight_cpus(slurm_cluster: SlurmCluster) -> None:
    out = slurm_cluster.run("sinfo", "--noheader", "--Node", "--format=%N %T %c %P")
    assert out.split() == [slurm_cluster.node, "idle", "8", "debug*"]


def test_two_task_batch_job_completes(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    out = tmp_path / "job.out"
    job_id = sbatch(slurm_cluster, out, "--ntasks=2", "--wrap", "srun hostname")
    assert slurm_cluster.wait_final_state(job_id) == "COMPLETED"
    assert out.read_text().split() == [slurm_cluster.node] * 2


def test_failing_job_is_failed(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    job_id = sbatch(slurm_cluster, tmp_path / "job.out", "--wrap", "exit 3")
    assert slurm_cluster.wait_final_state(job_id) == "FAILED"
    exit_code = slurm_cluster.run(
        "sacct", "-j", job_id, "-X", "--format=ExitCode", "--noheader", "--parsable2"
    )
    assert exit_code.strip() == "3:0"


def test_scancel_is_cancelled(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    job_id = sbatch(slurm_cluster, tmp_path / "job.out", "--wrap", "sleep 300")
    deadline = time.monotonic() + 30
    while slurm_cluster.run("squeue", "--noheader", "--jobs", job_id, "--format=%T").strip() != "RUNNING":
        assert time.monotonic() < deadline, f"job {job_id} did not start within 30 s"
        time.sleep(0.2)
    slurm_cluster.run("scancel", job_id)
    assert slurm_cluster.wait_final_state(job_id) == "CANCELLED"


def test_srun_two_tasks(slurm_cluster: SlurmCluster) -> None:
    out = slurm_cluster.run("srun", "--ntasks=2", "hostname")
    assert out.split() == [slurm_cluster.node] * 2


# ------------------------------------------------------------------------------------ multi-node
# A task's rendezvous as on a real cluster: the first host of the job's node list, resolved
# through /etc/hosts, on the node's own interface (GLOO_SOCKET_IFNAME=eth0).
FIRST_HOST = """
import os, subprocess
nodelist = os.environ["SLURM_JOB_NODELIST"]
first_host = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True,
                            text=True, check=True).stdout.split()[0]
rank, world_size = int(os.environ["SLURM_PROCID"]), int(os.environ["SLURM_NTASKS"])
"""
GLOO_ALL_REDUCE = (
    FIRST_HOST
    + """
import datetime, socket
import torch
import torch.distributed as dist
dist.init_process_group("gloo", init_method=f"tcp://{first_host}:29500", rank=rank,
                        world_size=world_size, timeout=datetime.timedelta(seconds=60))
total = torch.tensor([float(rank + 1)])
dist.all_reduce(total)
print(rank, socket.gethostname(), int(total.item()), flush=True)
dist.destroy_process_group()
"""
)
# Rank 1 sends NUM_BYTES to rank 0, which prints the rate from its first byte to its last.
SEND_RATE = (
    FIRST_HOST
    + """
import socket, sys, time
num_bytes, port = int(sys.argv[1]), 29501
if rank == 0:
    with socket.create_server(("", port)) as server:
        conn, _ = server.accept()
        received, started = 0, None
        while received < num_bytes:
            received += len(conn.recv(1 << 20))
            started = started or time.perf_counter()
        elapsed_s = time.perf_counter() - started
        conn.sendall(b"k")
        print(f"{received / elapsed_s / 1e6:.2f}", flush=True)
else:
    deadline = time.monotonic() + 30
    while True:
        try:
            conn = socket.create_connection((first_host, port), timeout=5)
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)
    conn.sendall(bytes(num_bytes))
    conn.recv(1)
"""
)


def python_tasks(
    cluster: SlurmCluster, tmp_path: Path, code: str, srun_args: list[str], args: tuple[str, ...] = ()
) -> list[str]:
    """`srun SRUN_ARGS python CODE ARGS`: the tasks' output lines. Judged by what the ranks printed,
    not srun's exit code: a gloo rank can abort at exit after printing (a few % of CPU launches)."""
    script = tmp_path / "task.py"
    script.write_text(code)
    srun = ["srun", "--export=ALL,GLOO_SOCKET_IFNAME=eth0", *srun_args]
    return cluster.run(*srun, sys.executable, str(script), *args, timeout_s=120, check=False).splitlines()


def leftovers(state_dir: Path, port: int) -> list[str]:
    """Anything of the cluster in STATE_DIR on PORT still there: a process whose command line or
    environment names the state dir, a link or namespace named after the port, a hosts line."""
    found = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            cmdline, environ = (proc / "cmdline").read_bytes(), (proc / "environ").read_bytes()
        except OSError:
            continue  # ended meanwhile
        if f"{state_dir}/".encode() in cmdline + environ:
            program = cmdline.split(b"\0")[0].decode(errors="replace")
            found.append(f"process {proc.name} {program}")
    prefix = f"sl{port}"  # the script names bridge, veths and namespaces after the port
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, check=True).stdout
    for line in links.splitlines():
        name = line.split(":")[1].strip().split("@")[0]
        if name.startswith(prefix):
            found.append(f"link {name}")
    netns_dir = Path("/var/run/netns")
    if netns_dir.is_dir():
        found += [f"netns {ns.name}" for ns in netns_dir.iterdir() if ns.name.startswith(prefix)]
    tag = f"# slurm-local {state_dir}"
    found += [f"hosts {line}" for line in Path("/etc/hosts").read_text().splitlines() if line.endswith(tag)]
    return found


@pytest.mark.multinode
def test_four_nodes_have_own_hostnames_and_addresses(slurm_cluster_4: SlurmCluster) -> None:
    cluster = slurm_cluster_4
    rows = [line.split() for line in cluster.run("sinfo", "-h", "-N", "-o", "%N %T %c %o").splitlines()]
    assert [state for _, state, _, _ in rows] == ["idle"] * 4
    assert [cpus for _, _, cpus, _ in rows] == ["2"] * 4
    assert len(set(cluster.nodes)) == len(set(cluster.node_addrs.values())) == 4
    assert socket.gethostname() not in cluster.nodes
    # Each task sees its node's hostname, which /etc/hosts resolves to the node's address.
    code = "import socket; h = socket.gethostname(); print(h, socket.gethostbyname(h))"
    out = cluster.run("srun", "-N4", "--ntasks-per-node=1", sys.executable, "-c", code)
    assert sorted(tuple(line.split()) for line in out.splitlines()) == sorted(cluster.node_addrs.items())


@pytest.mark.multinode
def test_gloo_all_reduce_across_two_nodes(slurm_cluster_4: SlurmCluster, tmp_path: Path) -> None:
    lines = python_tasks(slurm_cluster_4, tmp_path, GLOO_ALL_REDUCE, ["-N2", "-n4"])
    ranks = sorted(line.split() for line in lines)
    assert [rank for rank, _, _ in ranks] == ["0", "1", "2", "3"], lines
    assert [total for _, _, total in ranks] == ["10"] * 4  # 1 + 2 + 3 + 4
    hosts = [host for _, host, _ in ranks]
    assert hosts[0] == hosts[1] != hosts[2] == hosts[3]  # block distribution: 2 ranks per node
    assert set(hosts) <= set(slurm_cluster_4.nodes)


@pytest.mark.multinode
def test_links_between_nodes_are_shaped(slurm_cluster_4: SlurmCluster, tmp_path: Path) -> None:
    """The fixture's links carry 200 Mbit/s = 25 MB/s; two tasks on one node talk over the
    node's own stack, unshaped."""
    first, second = slurm_cluster_4.nodes[:2]
    num_bytes = str(32 * 2**20)  # 1.3 s at 25 MB/s
    intra = python_tasks(slurm_cluster_4, tmp_path, SEND_RATE, ["-N1", "-n2", f"-w{first}"], (num_bytes,))
    cross_args = ["-N2", "-n2", f"-w{first},{second}"]
    cross = python_tasks(slurm_cluster_4, tmp_path, SEND_RATE, cross_args, (num_bytes,))
    intra_mb_per_s, cross_mb_per_s = float(intra[0]), float(cross[0])
    print(f"intra-node {intra_mb_per_s} MB/s, cross-node {cross_mb_per_s} MB/s")
    assert cross_mb_per_s < 25 * 1.1
    assert intra_mb_per_s > 2 * cross_mb_per_s


@pytest.mark.multinode
@pytest.mark.parametrize(
    ("node_index", "fault", "heal"),
    [(3, [["kill-slurmd"]], [["start-slurmd"]]), (2, [["link", "down"]], [["link", "up"], ["resume"]])],
    ids=["killed-slurmd", "cut-link"],
)
def test_node_fault_ends_job_node_fail(
    slurm_cluster_4: SlurmCluster, tmp_path: Path, node_index: int, fault: list[list[str]],
    heal: list[list[str]],
) -> None:  # fmt: skip
    """SlurmdTimeout=10: the node is DOWN and its job NODE_FAIL ~30 s after the fault (measured
    27-32 s: slurmctld notices a silent slurmd at a ping, then declares it dead a timeout later)."""
    cluster, node = slurm_cluster_4, slurm_cluster_4.nodes[node_index]
    job_id = sbatch(cluster, tmp_path / "job.out", "--no-requeue", f"-w{node}", "--wrap", "sleep 300")
    cluster.wait_running(job_id)
    started = time.monotonic()
    try:
        for command, *args in fault:
            cluster.fault(command, node, *args)
        assert cluster.wait_final_state(job_id, timeout_s=60) == "NODE_FAIL"
        print(f"{fault}: NODE_FAIL after {time.monotonic() - started:.1f} s")
        assert cluster.node_state(node).startswith("down")
    finally:
        for command, *args in heal:
            cluster.fault(command, node, *args)
    cluster.wait_node_state(node, {"idle"}, timeout_s=60)


@pytest.mark.multinode
def test_restarted_daemons_keep_a_running_job(slurm_cluster_4: SlurmCluster, tmp_path: Path) -> None:
    cluster, out = slurm_cluster_4, tmp_path / "job.out"
    job_id = sbatch(cluster, out, "-N2", "--wrap", "srun sleep 15 && echo done")
    cluster.wait_running(job_id)
    cluster.fault("restart", "slurmctld")
    cluster.fault("restart", "slurmdbd")
    assert cluster.run("squeue", "-h", "-j", job_id, "-o", "%T").strip() == "RUNNING"
    assert cluster.wait_final_state(job_id) == "COMPLETED"
    assert out.read_text().split() == ["done"]


@pytest.mark.multinode
def test_drain_and_resume(slurm_cluster_4: SlurmCluster) -> None:
    """On a node whose last job ended a while ago: drained right after a job's end, a node can
    show "mixed" in sinfo for ~30 s after its resume (seen after the restart test above)."""
    cluster, node = slurm_cluster_4, slurm_cluster_4.nodes[3]
    cluster.wait_node_state(node, {"idle"})
    cluster.fault("drain", node)
    try:
        assert cluster.node_state(node) == "drained"
    finally:
        cluster.fault("resume", node)
    # RESUME marks the node not responding ("idle*") until slurmctld's next ping (~1 s).
    cluster.wait_node_state(node, {"idle"}, timeout_s=30)


@pytest.mark.multinode
def test_stop_leaves_nothing_behind() -> None:
    """A second, 2-node cluster beside the session's: after stop, no daemon, namespace, veth,
    bridge, qdisc or hosts line of it is left."""
    with slurm_cluster(nodes=2, inter_node_mbit=100) as cluster:
        created = (cluster.state_dir / "run" / "created").read_text().split("\n")
        kinds = sorted({line.split()[0] for line in created if line})
        assert kinds == ["hosts", "link", "netns", "qdisc"]
        there = leftovers(cluster.state_dir, cluster.port)
        daemons = {item.split()[2] for item in there if item.startswith("process")}
        assert daemons >= {"munged", "mariadbd", "slurmdbd", "slurmctld", "slurmd"}, there
        assert len([item for item in there if item.startswith("link")]) == 3, there  # bridge + 2 veths
        assert len([item for item in there if item.startswith(("netns", "hosts"))]) == 4, there
    assert leftovers(cluster.state_dir, cluster.port) == []


@pytest.mark.multinode
def test_start_failing_half_way_leaves_nothing(tmp_path: Path) -> None:
    """A start that dies after creating the bridge and a namespace (here: link latency on a kernel
    without sch_netem) removes them itself; with netem the links carry the delay."""
    state_dir = Path(tempfile.mkdtemp(prefix="tuner-slurm-"))
    state_dir.chmod(0o755)
    port = _free_port_base()
    env = {**os.environ, "SLURM_LOCAL_PORT": str(port)}
    script = ["bash", str(SCRIPT)]
    try:
        started = subprocess.run([*script, "start", "--nodes=2", "--inter-node-latency-ms=5", str(state_dir)],
                                 env=env, capture_output=True, text=True)  # fmt: skip
        if started.returncode != 0:
            assert "sch_netem" in started.stderr, started.stderr
            assert leftovers(state_dir, port) == []
        else:
            status = subprocess.run([*script, "status", str(state_dir)], capture_output=True, text=True)
            assert status.stdout.count("delay 5ms") == 2, status.stdout
    finally:
        subprocess.run([*script, "stop", str(state_dir)], env=env, capture_output=True)
        assert leftovers(state_dir, port) == []
        shutil.rmtree(state_dir, ignore_errors=True)
