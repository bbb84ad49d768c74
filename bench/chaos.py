"""The chaos run: a study of real trials left alone while things break, then what the database
and Slurm's accounting say about it.

One study (gpt-tiny on CPU ranks, world sizes 1, 2 and 4, the `grid` sampler so that a calm run
measures the same layouts) runs on a real local Slurm cluster (scripts/slurm-local.sh) with a real
PostgreSQL and two `tuner worker`s, while a driver injects faults at random times from a seed:
SIGKILL the worker holding the study (started again later), make `sbatch` fail for a while (a
wrapper first on PATH fails ~30 % of calls), `scancel` a running job, restart slurmctld, stop
PostgreSQL for a few seconds, SIGKILL one rank of a running trial, set the node DOWN under a
running job (NODE_FAIL). A calm run of the same study comes first, on the same services
(`--no-calm` leaves it out: the test's short run checks what the database and sacct say, not
which layout won).

Checked at the end, from the database and from sacct:
- the study is COMPLETE with exactly max_trials trials, each in a final state (lost = 0);
- no attempt ran twice: each job name (study, trial, attempt) at most once in sacct, at most one
  successful attempt per trial, each layout once (duplicated = 0);
- every job sacct knows under the study's names is an attempt the database recorded (orphans = 0);
- INFRA attempts were retried, and no trial ending infra or cancelled was told to the sampler;
- the best layout is the calm run's best, or measured within noise of it there, or the run
  says why not.

    .venv/bin/python -m bench.chaos --trials 24 --seed 1 --json

Needs root (the Slurm cluster). Takes ~10-15 minutes on 2 cores (calm run included).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from sqlalchemy.exc import SQLAlchemyError

from tests.postgres import PostgresServer, postgres_instance
from tests.slurm_cluster import SlurmCluster, slurm_cluster
from trainer.contract.trial_dir import CONFIG_FILE
from tuner import store
from tuner.db import connect, make_engine
from tuner.dispatch import JobHandle
from tuner.outcome import FailureKind, Feedback, StudyStatus, TrialState
from tuner.spec import parse_spec

TUNER = shutil.which("tuner", path=str(Path(sys.executable).parent)) or "tuner"
KINDS = ("worker_kill", "sbatch_fail", "scancel", "slurmctld_restart", "postgres_restart", "rank_kill",
         "node_fail")  # fmt: skip
# On a cluster of several nodes (--nodes N): a node's slurmd killed, its network cut, a node drained.
NODE_KINDS = ("slurmd_kill", "link_cut", "drain")
SBATCH_WRAPPER = """#!/bin/bash
# bench/chaos.py: while the flag file exists, ~30 % of submissions fail as a busy controller's do
if [ -e {flag} ] && [ $((RANDOM % 100)) -lt 30 ]; then
  echo "$(date +%s.%N)" >> {log}
  echo "sbatch: error: Batch job submission failed: Socket timed out on send/recv operation (chaos)" >&2
  exit 1
fi
exec {sbatch} "$@"
"""


def study_spec(name: str, trials: int, seed: int, nodes: int = 1) -> dict:
    """One node of 8 CPU "devices", or `nodes` of 2 (a 4-rank trial then spans two nodes)."""
    return {
        "name": name, "model": "gpt-tiny", "num_gpus": 4,
        # A cluster name per study: each starts from the same (uncalibrated) prior, so `grid` asks
        # for the same layouts in the same order in the calm run and in the chaos run.
        "cluster": {"preset": "cpu-local", "name": f"cpu-{name}", "gpus_per_node": 8 if nodes == 1 else 2,
                    "num_nodes": nodes},
        "training": {"global_batch_size": 8, "precision": "fp32"},
        "space": {"num_gpus": [1, 2, 4], "tp": [1, 2, 4], "pp": [1, 2], "micro_batch_size": [2, 4, 8],
                  "zero_stage": [0, 3], "activation_checkpoint": ["none", "full"], "sequence_parallel": [False],
                  "pp_schedule": ["1f1b"]},
        # One trial at a time: on 2 cores a neighbour's ranks would decide a trial's speed.
        "budget": {"max_trials": trials, "trials_in_flight": 1, "max_device_hours": 2.0},
        # Every trial measures all its steps (no adaptive stop, no pruning): the runs recorded in
        # docs/benchmarks.md did, and a fault needs a trial running to hit.
        "trial": {"warmup_steps": 2, "measure_steps": 30, "stable_rel_ci": None, "prune_running_fraction": None,
                  "timeout_s": 240, "device": "cpu", "max_retries": 3,
                  "dispatch_backoff_s": 1.0, "max_dispatch_failures": 6, "dispatch_pause_s": 10},
        "sampler": "grid", "prune_predicted_oom": False, "backend": "slurm", "seed": seed,
        "slurm": {"partition": "debug", "env": {"GLOO_SOCKET_IFNAME": "lo" if nodes == 1 else "eth0"}},
    }  # fmt: skip


@dataclass
class Services:
    cluster: SlurmCluster
    pg: PostgresServer
    work: Path
    env: dict[str, str]
    flag: Path
    fail_log: Path


@contextlib.contextmanager
def services(keep: Path | None = None, nodes: int = 1):
    """Slurm (one node of 8 CPUs, or `nodes` of 2 with links shaped to 200 Mbit/s), PostgreSQL,
    and an sbatch wrapper first on the workers' PATH."""
    work = Path(tempfile.mkdtemp(prefix="tuner-chaos-", dir=keep))
    shaped = {"inter_node_mbit": 200} if nodes > 1 else {}
    with slurm_cluster(nodes=nodes, **shaped) as cluster, postgres_instance() as pg:
        wrapper_dir = work / "bin"
        wrapper_dir.mkdir()
        flag, fail_log = work / "sbatch-fail", work / "sbatch-failures.log"
        sbatch = shutil.which("sbatch", path=cluster.env["PATH"])
        (wrapper_dir / "sbatch").write_text(SBATCH_WRAPPER.format(flag=flag, log=fail_log, sbatch=sbatch))
        (wrapper_dir / "sbatch").chmod(0o755)
        env = {**cluster.env, "PATH": f"{wrapper_dir}:{cluster.env['PATH']}", "TUNER_DATABASE_URL": pg.url,
               "TUNER_WORK_DIR": str(work / "runs"), "TUNER_LEASE_S": "15", "PYTHONUNBUFFERED": "1"}  # fmt: skip
        try:
            yield Services(cluster, pg, work, env, flag, fail_log)
        finally:
            if keep is None:
                shutil.rmtree(work, ignore_errors=True)


class Workers:
    """`tuner worker` processes, each in its own session, logs in the work dir."""

    def __init__(self, svc: Services, n: int):
        self.svc, self.procs, self.started = svc, [], 0
        self.lock, self.closed = threading.Lock(), False
        for _ in range(n):
            self.start()

    def start(self) -> subprocess.Popen | None:
        """A new worker; none once stopped (a worker_kill's restart timer may fire after stop())."""
        with self.lock:
            if self.closed:
                return None
            self.started += 1
            log = open(self.svc.work / f"worker-{self.started}.log", "wb")  # noqa: SIM115
            proc = subprocess.Popen([TUNER, "worker", "--poll-s", "0.5"], env=self.svc.env, stdout=log,
                                    stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
            self.procs.append(proc)
            return proc

    def alive(self) -> list[subprocess.Popen]:
        return [p for p in self.procs if p.poll() is None]

    def stop(self) -> None:
        with self.lock:
            self.closed = True
        for p in self.alive():
            p.send_signal(signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def _study(sessions, name: str):
    with sessions() as s:
        return store.get_study(s, name)


def _running_jobs(sessions, name: str) -> list[JobHandle]:
    with sessions() as s:
        study = store.get_study(s, name)
        return [JobHandle.parse(t.job_id) for t in store.trials(s, study, (TrialState.RUNNING,)) if t.job_id]


@dataclass
class Chaos:
    """The fault driver: every 4-10 s one fault whose precondition holds, kinds in a seeded
    order so that each kind comes early."""

    svc: Services
    workers: Workers
    name: str
    rng: random.Random
    injected: Counter = field(default_factory=Counter)
    events: list[str] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        sessions = _sessions(self.svc.pg.url)
        order = list(KINDS) + (list(NODE_KINDS) if len(self.svc.cluster.nodes) > 1 else [])
        self.rng.shuffle(order)
        while not self.stop.wait(self.rng.uniform(4, 10)):
            known = KINDS + (NODE_KINDS if len(self.svc.cluster.nodes) > 1 else ())
            kinds = order or [self.rng.choice(known) for _ in range(3)]
            for kind in list(kinds):
                try:
                    done = getattr(self, kind)(sessions)
                except (SQLAlchemyError, RuntimeError, OSError, subprocess.SubprocessError) as e:
                    self.events.append(f"{time.strftime('%H:%M:%S')} {kind} failed to inject: {e}")
                    done = False
                if done:
                    self.injected[kind] += 1
                    self.events.append(f"{time.strftime('%H:%M:%S')} {kind}: {done}")
                    if kind in order:
                        order.remove(kind)
                    break

    # --- the faults: each returns what it did, or False when it cannot now ---

    def worker_kill(self, sessions):
        study = _study(sessions, self.name)
        holder = [p for p in self.workers.alive() if study and p.pid == study.lease_pid]
        if not holder:
            return False
        holder[0].kill()
        delay = self.rng.uniform(5, 15)
        threading.Timer(delay, self.workers.start).start()
        return f"SIGKILL worker {holder[0].pid} (holding the study); a new worker in {delay:.0f} s"

    def sbatch_fail(self, sessions):
        if self.svc.flag.exists():
            return False
        self.svc.flag.touch()
        seconds = self.rng.uniform(40, 70)
        threading.Timer(seconds, lambda: self.svc.flag.unlink(missing_ok=True)).start()
        return f"sbatch fails ~30 % of calls for {seconds:.0f} s"

    def scancel(self, sessions):
        jobs = [j for j in _running_jobs(sessions, self.name) if j.kind == "slurm"]
        if not jobs:
            return False
        job = self.rng.choice(jobs)
        self.svc.cluster.run("scancel", job.id)
        return f"scancel {job.id}"

    def slurmctld_restart(self, sessions):
        self.svc.cluster.fault("restart", "slurmctld")
        return "slurmctld restarted"

    def postgres_restart(self, sessions):
        down = self.rng.uniform(2, 8)
        self.svc.pg.restart(down_s=down)
        return f"PostgreSQL down {down:.0f} s"

    def rank_kill(self, sessions):
        ranks = [pid for job in _running_jobs(sessions, self.name) for pid in _ranks(job.work_dir)]
        if not ranks:
            return False
        pid = self.rng.choice(ranks)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        return f"SIGKILL rank pid {pid}"

    def _busy_node(self, sessions) -> str | None:
        """A node that runs one of the study's jobs now."""
        jobs = [j.id for j in _running_jobs(sessions, self.name) if j.kind == "slurm"]
        if not jobs:
            return None
        nodelist = self.svc.cluster.run("squeue", "-h", "-t", "R", "-j", ",".join(jobs), "-o", "%N").split()
        nodes = sorted(
            {n for nl in nodelist for n in self.svc.cluster.run("scontrol", "show", "hostnames", nl).split()}
        )
        return self.rng.choice(nodes) if nodes else None

    def slurmd_kill(self, sessions):
        node = self._busy_node(sessions)
        if node is None:
            return False
        self.svc.cluster.fault("kill-slurmd", node)
        later = self.rng.uniform(40, 60)
        threading.Timer(
            later, lambda: (self.svc.cluster.fault("start-slurmd", node), self._resume(node))
        ).start()
        return f"slurmd of {node} SIGKILLed under a running job; started again in {later:.0f} s"

    def link_cut(self, sessions):
        node = self._busy_node(sessions)
        if node is None:
            return False
        self.svc.cluster.fault("link", node, "down")
        later = self.rng.uniform(40, 60)
        threading.Timer(
            later, lambda: (self.svc.cluster.fault("link", node, "up"), self._resume(node))
        ).start()
        return f"network of {node} cut under a running job; restored in {later:.0f} s"

    def drain(self, sessions):
        node = self.rng.choice(self.svc.cluster.nodes)
        self.svc.cluster.fault("drain", node)
        later = self.rng.uniform(30, 60)
        threading.Timer(later, lambda: self._resume(node)).start()
        return f"{node} drained for {later:.0f} s"

    def _resume(self, node: str) -> None:
        self.svc.cluster.run("scontrol", "update", f"nodename={node}", "state=resume", check=False)

    def node_fail(self, sessions):
        node = self._busy_node(sessions) if len(self.svc.cluster.nodes) > 1 else self.svc.cluster.node
        if node is None or not _running_jobs(sessions, self.name):
            return False
        self.svc.cluster.run("scontrol", "update", f"nodename={node}", "state=down", "reason=chaos")

        def resume() -> None:
            self.svc.cluster.run("scontrol", "update", f"nodename={node}", "state=resume", check=False)

        threading.Timer(self.rng.uniform(3, 6), resume).start()
        return f"node {node} DOWN under running jobs (NODE_FAIL), resumed shortly after"


def _ranks(work_dir: Path) -> list[int]:
    """The trainer processes of the trial in `work_dir` (its config path is on their command line)."""
    config = str(work_dir / CONFIG_FILE)
    pids = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                cmd = (proc / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if b"trainer.benchmark" in cmd and config.encode() in cmd:
                pids.append(int(proc.name))
    return pids


def _sessions(url: str):
    from sqlalchemy.orm import sessionmaker

    return sessionmaker(make_engine(url), expire_on_commit=False)


def _wait_final(sessions, name: str, timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            study = _study(sessions, name)
            if study is not None and store.status_of(study).is_final:
                return study.status
        except SQLAlchemyError:
            pass
        time.sleep(2)
    return "TIMEOUT"


def run_study(svc: Services, name: str, trials: int, seed: int, *, chaos: bool,
              timeout_s: float) -> tuple[str, float, Chaos | None]:  # fmt: skip
    sessions = connect(svc.pg.url)
    with sessions.begin() as s:
        store.create_study(s, parse_spec(study_spec(name, trials, seed, len(svc.cluster.nodes))))
    started = time.monotonic()
    workers = Workers(svc, 2)
    driver = Chaos(svc, workers, name, random.Random(seed)) if chaos else None
    thread = threading.Thread(target=driver.run, daemon=True) if driver else None
    if thread:
        thread.start()
    try:
        status = _wait_final(sessions, name, timeout_s)
    finally:
        if driver:
            driver.stop.set()
            thread.join()
            svc.flag.unlink(missing_ok=True)
            time.sleep(16)  # a worker restart scheduled by the last fault
            for node in svc.cluster.nodes:  # and nodes a fault left down or drained
                svc.cluster.run("scontrol", "update", f"nodename={node}", "state=resume", check=False)
        workers.stop()
    return status, time.monotonic() - started, driver


def sacct_jobs(svc: Services) -> list[tuple[str, str, str, str, str]]:
    """(job id, name, state, elapsed s, CPUs) of every job the cluster ran, once accounting settled."""
    time.sleep(5)
    out = svc.cluster.run("sacct", "-X", "-n", "-P", "--format=JobIDRaw,JobName,State,ElapsedRaw,AllocCPUS",
                          "-S", "now-1days")  # fmt: skip
    return [tuple(line.split("|")[:5]) for line in out.splitlines() if line.count("|") >= 4]  # type: ignore[misc]


def check(svc: Services, name: str, calm: str | None, trials: int) -> dict:
    """The run's figures; the comparison with the calm run's best only where one ran."""
    sessions = connect(svc.pg.url)
    with sessions() as s:
        study = store.get_study(s, name)
        rows = store.trials(s, study)
        best = store.best_trial(s, study)
        calm_study = store.get_study(s, calm) if calm else None
        calm_rows = {t.layout_key: t for t in store.trials(s, calm_study)} if calm_study else {}
        calm_best = store.best_trial(s, calm_study) if calm_study else None
        study_id, status, reason = study.id, study.status, study.error
    counted = [t for t in rows if t.state is not TrialState.PRUNED]
    unfinished = [t.number for t in rows if not t.state.is_finished()]
    lost = len(unfinished) + max(0, trials - len(counted))
    # Jobs by name: pt<study>-t<trial>-a<attempt>; each attempt at most once.
    all_jobs = sacct_jobs(svc)
    jobs = [(i, n, st) for i, n, st, *_ in all_jobs if n.startswith(f"pt{study_id}-t")]
    sacct_device_hours = round(sum(int(e or 0) * int(c or 0) for _, n, _, e, c in all_jobs
                                   if n.startswith(f"pt{study_id}-t")) / 3600, 4)  # fmt: skip
    names = Counter(n for _, n, _ in jobs)
    ok_attempts = {t.number: sum(e["kind"] == "ok" for e in t.attempt_log or []) for t in rows}
    layouts = Counter(t.layout_key for t in rows)
    duplicated = (sum(c - 1 for c in names.values()) + sum(max(0, c - 1) for c in ok_attempts.values())
                  + sum(c - 1 for c in layouts.values()))  # fmt: skip
    known = {JobHandle.parse(e["job"]).id for t in rows for e in t.attempt_log or [] if e.get("job")}
    known |= {JobHandle.parse(t.job_id).id for t in rows if t.job_id}
    orphans = sorted(i for i, _, _ in jobs if i not in known)
    attempts = Counter(e["kind"] for t in rows for e in t.attempt_log or [])
    told_wrongly = [
        t.number
        for t in rows
        if t.failure_kind in (FailureKind.INFRA, FailureKind.CANCELLED) and t.told != Feedback.NOTHING
    ]
    infra_retried = sum(
        e["kind"] == FailureKind.INFRA for t in rows for e in (t.attempt_log or [])[:-1]
    )  # not the last: re-run
    # The best layout against the calm run's measurements of the same layouts. Noise: the median
    # run-to-run difference |log(chaos / calm)| of the layouts both runs measured.
    both = [(t, calm_rows[t.layout_key]) for t in rows
            if t.tokens_per_s and calm_rows.get(t.layout_key) and calm_rows[t.layout_key].tokens_per_s]  # fmt: skip
    diffs = sorted(abs(math.log(a.tokens_per_s / b.tokens_per_s)) for a, b in both)
    noise = diffs[len(diffs) // 2] if diffs else 0.0
    best_key = best.layout_key if best else None
    calm_key = calm_best.layout_key if calm_best else None
    same = best_key == calm_key
    twin = next((t for t in rows if t.layout_key == calm_key), None)
    # Within noise: the calm run measured this run's best within 2 x noise of its own best.
    calm_of_best = calm_rows.get(best_key) if best_key else None
    gap = (math.log(calm_best.tokens_per_s / calm_of_best.tokens_per_s)
           if calm_best and calm_of_best and calm_of_best.tokens_per_s else math.inf)  # fmt: skip
    near = same or gap <= 2 * noise
    why = None
    if calm is None:
        same = near = None
    elif not same:
        why = (f"the calm run's best was not measured here: trial {twin.number} ended {twin.state.word} "
               f"{twin.failure_kind or ''}".strip() if twin is not None and twin.state is not TrialState.COMPLETE else
               f"the calm run measured this best {gap:.0%} (log) below its own best; run-to-run noise of the "
               f"same layouts between the two runs is {noise:.0%} (median |log ratio| over {len(both)} layouts)")  # fmt: skip
    device_hours = sum(t.device_s for t in rows) / 3600
    return {
        "trials": len(counted), "study_status": status, "status_reason": reason, "lost": lost,
        "unfinished": unfinished, "duplicated": duplicated, "orphan_jobs": len(orphans), "orphans": orphans,
        "jobs": len(jobs), "attempt_kinds": dict(attempts), "infra_attempts_retried": infra_retried,
        "told_wrongly": told_wrongly, "final_kinds": dict(Counter(t.failure_kind or "ok" for t in counted)),
        "device_hours": round(device_hours, 4), "max_trial_device_hours": round(max((t.device_s for t in rows),
                                                                                    default=0) / 3600, 4),
        "best_layout": best and store.config_of(best).describe(), "calm_best_layout": calm_best
        and store.config_of(calm_best).describe(), "best_is_calm_best": same, "best_within_noise": near,
        "run_to_run_noise": round(noise, 3), "best_why_not": why, "device_hours_sacct": sacct_device_hours,
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trials", type=int, default=24)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json", action="store_true", help="print the figures as one JSON object")
    ap.add_argument("--timeout-s", type=float, default=3600, help="per study")
    ap.add_argument("--keep", type=Path, help="keep the work dir (logs, trial dirs) under this dir")
    ap.add_argument("--nodes", type=int, default=1, help="Slurm nodes (>1: node faults too; 2 CPUs each)")
    ap.add_argument(
        "--no-calm",
        dest="calm",
        action="store_false",
        help="no calm run first (no comparison of the best layouts; half the time)",
    )
    args = ap.parse_args(argv)
    if os.geteuid() != 0:
        raise SystemExit("the chaos run starts a Slurm cluster: run it as root")
    # SIGTERM (a caller's timeout) unwinds like an error: the workers (in their own sessions, so a
    # signal to this process group misses them), the Slurm cluster and PostgreSQL are stopped.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    with services(args.keep, args.nodes) as svc:
        calm_status, calm_wall = None, None
        if args.calm:
            calm_status, calm_wall, _ = run_study(
                svc, "calm", args.trials, args.seed, chaos=False, timeout_s=args.timeout_s
            )
        _status, wall, driver = run_study(
            svc, "chaos", args.trials, args.seed, chaos=True, timeout_s=args.timeout_s
        )
        figures = check(svc, "chaos", "calm" if args.calm else None, args.trials)
        failures = len(svc.fail_log.read_text().splitlines()) if svc.fail_log.exists() else 0
    figures |= {"faults_injected": dict(driver.injected), "faults": sum(driver.injected.values()),
                "sbatch_calls_failed": failures, "events": driver.events, "wall_s": round(wall, 1),
                "calm_wall_s": calm_wall and round(calm_wall, 1), "calm_status": calm_status, "seed": args.seed,
                "nodes": args.nodes}  # fmt: skip
    budget = study_spec("chaos", args.trials, args.seed, args.nodes)["budget"]["max_device_hours"]
    figures["within_budget"] = (figures["trials"] == args.trials
                                and figures["device_hours"] <= budget + figures["max_trial_device_hours"])  # fmt: skip
    ok = (figures["study_status"] == StudyStatus.COMPLETE and figures["within_budget"]
          and figures["lost"] == figures["duplicated"] == figures["orphan_jobs"] == 0
          and not figures["told_wrongly"])  # fmt: skip
    if args.json:
        print(json.dumps(figures, indent=1))
    else:
        for event in figures.pop("events"):
            print(event)
        print(json.dumps(figures, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
