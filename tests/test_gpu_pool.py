"""One host, several GPUs (pkv/config/gpus.py, pkv/cli/gpu_pool.py, docs/multigpu.md):
concurrent jobs never share a GPU, a killed job frees its GPU, a host of mixed GPU models is
refused before any job runs, and with gpu=1 nothing changes. On the CPU, with fake device
lists: the pool's UUIDs in PKV_GPUS, and a fake `nvidia-smi` on PATH for the Snakefile."""

from __future__ import annotations

import datetime
import itertools
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from pkv.cli import gpu_pool
from pkv.config import gpus
from pkv.config.errors import ConfigError

REPO = Path(__file__).resolve().parents[1]
SNAKEMAKE = [sys.executable, "-m", "snakemake"]

# A fake job: takes a GPU as `python3 -m pkv.cli measure` does, says which and when, holds it a while.
JOB = textwrap.dedent("""
    import json, os, sys, time
    from pkv.cli.gpu_pool import take
    gpu = take(["measure", "serve"])
    start = time.monotonic()
    time.sleep(float(sys.argv[2]))
    rec = {"gpu": gpu, "visible": os.environ.get("CUDA_VISIBLE_DEVICES"), "pool": os.environ.get("PKV_GPUS"),
           "start": start, "end": time.monotonic(), "pid": os.getpid()}
    with open(sys.argv[1], "a") as f:
        f.write(json.dumps(rec) + "\\n")
""")


def pool_env(tmp_path: Path, ids: list[str], **extra) -> dict[str, str]:
    locks = tmp_path / "locks"
    locks.mkdir(exist_ok=True)
    env = {**os.environ, "PYTHONPATH": str(REPO), "PKV_GPUS": ",".join(ids), "PKV_GPU_LOCKS": str(locks), **extra}
    env.pop("CUDA_VISIBLE_DEVICES", None)
    return env


def wait_for(predicate, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


# ---------------------------------------------------------------- the job's side


def test_concurrent_jobs_never_share_a_gpu(tmp_path):
    ids = ["GPU-aaa", "GPU-bbb", "GPU-ccc"]
    env, log = pool_env(tmp_path, ids), tmp_path / "jobs.jsonl"
    procs = [subprocess.Popen([sys.executable, "-c", JOB, str(log), "0.4"], env=env) for _ in range(9)]
    assert [p.wait(timeout=120) for p in procs] == [0] * 9
    jobs = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(jobs) == 9
    for job in jobs:   # pinned to its GPU alone; its own children take none
        assert job["gpu"] in ids and job["visible"] == job["gpu"] and job["pool"] is None
    for gpu in ids:
        spans = sorted((j["start"], j["end"]) for j in jobs if j["gpu"] == gpu)
        assert all(a_end <= b_start for (_, a_end), (b_start, _) in itertools.pairwise(spans)), (gpu, spans)
    assert {j["gpu"] for j in jobs} == set(ids)    # nine jobs on three GPUs: each GPU served some


def test_a_killed_job_frees_its_gpu(tmp_path):
    """SIGKILL: nothing runs to clean up, the kernel drops the flock. A child the job left
    behind does not keep the GPU (the lock is not inherited)."""
    env, log = pool_env(tmp_path, ["GPU-only"]), tmp_path / "jobs.jsonl"
    lock = Path(env["PKV_GPU_LOCKS"]) / "GPU-only.lock"
    leaver = JOB.replace('time.sleep(float(sys.argv[2]))',
                         'import subprocess; open(sys.argv[1] + ".child", "w").write(str(subprocess.Popen('
                         '["sleep", "60"]).pid)); time.sleep(float(sys.argv[2]))')
    first = subprocess.Popen([sys.executable, "-c", leaver, str(log), "60"], env=env)
    child = Path(f"{log}.child")
    try:
        wait_for(lambda: gpu_pool.holder(lock) == first.pid and child.exists())
        second = subprocess.Popen([sys.executable, "-c", JOB, str(log), "0"], env=env, stderr=subprocess.PIPE,
                                  text=True)
        time.sleep(1.0)
        assert second.poll() is None        # waits: the one GPU is taken
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=30)
        _, err = second.communicate(timeout=60)
        assert second.returncode == 0 and "all 1 GPUs of the pool are taken" in err
        jobs = [json.loads(line) for line in log.read_text().splitlines()]
        assert [j["gpu"] for j in jobs] == ["GPU-only"] and jobs[0]["pid"] == second.pid
        assert gpu_pool.holder(lock) is None
    finally:
        first.kill()
        if child.exists():
            try:
                os.kill(int(child.read_text()), signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_the_command_line_takes_a_gpu_before_it_runs(tmp_path):
    """`python3 -m pkv.cli` (what every rule runs): a GPU command waits for a free GPU of the
    pool, a table command does not."""
    env = pool_env(tmp_path, ["GPU-x"], PKV_WORKER="off")
    held = gpu_pool._try_lock(Path(env["PKV_GPU_LOCKS"]) / "GPU-x.lock")
    try:
        table = subprocess.run([sys.executable, "-m", "pkv.cli", "report", "--help"], env=env, cwd=REPO,
                               capture_output=True, text=True, timeout=120)
        assert table.returncode == 0
        gpu = subprocess.Popen([sys.executable, "-m", "pkv.cli", "measure", "--help"], env=env, cwd=REPO,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        time.sleep(3.0)
        assert gpu.poll() is None
    finally:
        held.close()
    out, err = gpu.communicate(timeout=120)
    assert gpu.returncode == 0 and "usage:" in out and "all 1 GPUs of the pool are taken" in err


def test_without_a_pool_nothing_changes(tmp_path):
    """gpu=1 (no PKV_GPUS): the environment is left as it is and no lock is taken; a command
    that uses no GPU takes none either."""
    env = {"CUDA_VISIBLE_DEVICES": "3"}
    assert gpu_pool.take(["measure", "serve"], env) is None and env == {"CUDA_VISIBLE_DEVICES": "3"}
    locks = tmp_path / "locks"
    locks.mkdir()
    env = {"PKV_GPUS": "GPU-a", "PKV_GPU_LOCKS": str(locks)}
    assert gpu_pool.take(["report", "results"], env) is None and env == {"PKV_GPUS": "GPU-a",
                                                                         "PKV_GPU_LOCKS": str(locks)}
    assert not list(locks.iterdir())


def test_a_missing_lock_folder_is_one_line(tmp_path):
    env = {"PKV_GPUS": "GPU-a", "PKV_GPU_LOCKS": str(tmp_path / "gone")}
    done = subprocess.run([sys.executable, "-m", "pkv.cli", "measure", "--help"], cwd=REPO, capture_output=True,
                          text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(REPO), **env})
    assert done.returncode == 2 and done.stderr.strip().count("\n") == 0 and "PKV_GPU_LOCKS" in done.stderr
    with pytest.raises(OSError, match="PKV_GPU_LOCKS=''"):    # unset: never the working folder
        gpu_pool.take(["measure"], {"PKV_GPUS": "GPU-a"})


def fake_sysfs(root: Path, siblings: dict[int, str]) -> Path:
    for cpu, text in siblings.items():
        (root / f"cpu{cpu}" / "topology").mkdir(parents=True)
        (root / f"cpu{cpu}" / "topology" / "thread_siblings_list").write_text(text + "\n")
    return root


def test_core_slices_keep_hyperthreads_together(tmp_path):
    sysfs = fake_sysfs(tmp_path, {c: f"{c % 4},{c % 4 + 4}" for c in range(8)})   # core k: cpus k and k+4
    assert gpu_pool.slot_cpus(0, 2, list(range(8)), sysfs) == {0, 4, 1, 5}
    assert gpu_pool.slot_cpus(1, 2, list(range(8)), sysfs) == {2, 6, 3, 7}
    slices = [gpu_pool.slot_cpus(s, 4, list(range(8)), sysfs) for s in range(4)]
    assert slices == [{0, 4}, {1, 5}, {2, 6}, {3, 7}]
    assert gpu_pool.slot_cpus(5, 8, list(range(8)), sysfs) == {1, 5}   # fewer cores than slots: shared


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="no sched_setaffinity")
def test_pinned_job_runs_on_its_slot_cores(tmp_path):
    env = pool_env(tmp_path, ["GPU-a", "GPU-b"], PKV_PIN_CORES="on")
    probe = ("import os; from pkv.cli.gpu_pool import take, slot_cpus; import sys; cmd = sys.argv[1]; "
             "gpu = take([cmd]); print(sorted(os.sched_getaffinity(0)) == sorted(slot_cpus(['GPU-a', 'GPU-b']"
             ".index(gpu), 2, sorted(ALL))), sorted(os.sched_getaffinity(0)) == sorted(ALL), "
             "os.environ.get('PKV_PINNED_CPUS') == ','.join(map(str, sorted(os.sched_getaffinity(0)))))")
    probe = probe.replace("ALL", repr(sorted(os.sched_getaffinity(0))))
    pinned = subprocess.run([sys.executable, "-c", probe, "measure"], env=env, capture_output=True, text=True,
                            timeout=60)
    build = subprocess.run([sys.executable, "-c", probe, "build-kernels"], env=env, capture_output=True, text=True,
                           timeout=60)
    # Its slot's share, named in the environment (which keys the warm worker: a pinned job
    # never goes to a worker an unpinned command started).
    assert pinned.stdout.split()[0] == pinned.stdout.split()[2] == "True", pinned.stderr
    assert build.stdout.split()[1:] == ["True", "False"], build.stderr      # the build keeps every core


# ---------------------------------------------------------------- the host's side (parse time)

H200 = [gpus.Gpu(0, "GPU-aaaa-1111", "NVIDIA H200"), gpus.Gpu(1, "GPU-bbbb-2222", "NVIDIA H200")]
MIXED = [H200[0], gpus.Gpu(1, "GPU-cccc-3333", "NVIDIA H100 80GB HBM3"), gpus.Gpu(2, "GPU-dddd-4444", "NVIDIA H200")]


def test_parse_smi():
    text = "0, GPU-aaaa-1111, NVIDIA H200\n1, GPU-bbbb-2222, NVIDIA H200\n\n"
    assert gpus.parse_smi(text) == H200
    with pytest.raises(ConfigError, match="line 1 is not 'index, uuid, name'"):
        gpus.parse_smi("No devices were found\n")


def test_cuda_visible_devices_chooses_among_the_gpus():
    assert gpus.visible(MIXED, None) == MIXED
    assert gpus.visible(MIXED, "2,0") == [MIXED[2], MIXED[0]]
    assert gpus.visible(MIXED, "GPU-dddd") == [MIXED[2]]
    assert gpus.visible(MIXED, "") == []
    for bad in ("7", "GPU-zz", "MIG-1"):
        with pytest.raises(ConfigError, match="names no GPU of this host"):
            gpus.visible(MIXED, bad)


def test_a_mixed_host_is_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"2 models \(NVIDIA H200: GPU 0, 2; NVIDIA H100 80GB HBM3: GPU 1\)"):
        gpus.pool({"gpu": 3}, "paper", True, {}, MIXED, tmp_path)
    one = gpus.pool({"gpu": 3}, "paper", True, {"CUDA_VISIBLE_DEVICES": "0,2"}, MIXED, tmp_path)   # one model chosen
    assert one.gpus == (MIXED[0], MIXED[2]) and one.label == "NVIDIA H200x2"


def test_pool_only_for_several_gpus_of_the_paper_profile(tmp_path):
    for resources, profile in [({}, "paper"), ({"gpu": 1}, "paper"), ({"gpu": 4}, "smoke"), (None, "paper")]:
        assert gpus.pool(resources, profile, True, {}, MIXED, tmp_path) is None
    pool = gpus.pool({"gpu": 8, "_cores": 8}, "paper", True, {}, H200, tmp_path / "locks")
    assert pool.slots == 2 and pool.model == "NVIDIA H200" and (tmp_path / "locks").is_dir()
    assert pool.env == {"PKV_GPUS": "GPU-aaaa-1111,GPU-bbbb-2222", "PKV_GPU_LOCKS": str(tmp_path / "locks")}
    assert gpus.pool({"gpu": 2}, "paper", False, {}, [], tmp_path) is None     # a dry run without GPUs plans
    with pytest.raises(ConfigError, match="this host shows no GPU"):
        gpus.pool({"gpu": 2}, "paper", True, {}, [], tmp_path)


# ---------------------------------------------------------------- the Snakefile, with a fake nvidia-smi

FAKE_SMI = textwrap.dedent("""\
    #!{python}
    import os, sys
    rows = [r.split(", ") for r in os.environ["FAKE_GPUS"].split(";")]
    if "--query-gpu=name" in sys.argv:
        print("\\n".join(r[2] for r in rows))
    else:
        print("\\n".join(", ".join(r) for r in rows))
""")


def dry_run(tmp_path: Path, fake_gpus: list[str], *args: str) -> subprocess.CompletedProcess:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "nvidia-smi").write_text(FAKE_SMI.format(python=sys.executable))
    (bin_dir / "nvidia-smi").chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "FAKE_GPUS": ";".join(fake_gpus),
           "TMPDIR": str(tmp_path), "PYTHONPATH": str(REPO)}
    env.pop("CUDA_VISIBLE_DEVICES", None)
    return subprocess.run([*SNAKEMAKE, "all", "-n", "--forceall", "--workflow-profile", "none", *args], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=600)


def inputs_of(text: str, rule: str) -> str:
    """The `input:` line of `rule`'s job in a dry run's listing ("" without one)."""
    lines = itertools.takewhile(lambda line: line.startswith(" "), text.split(f"rule {rule}:\n", 1)[1].splitlines())
    return next((line for line in lines if line.strip().startswith("input:")), "")


def test_snakefile_refuses_a_mixed_host_and_fans_out_on_one_model(tmp_path):
    mixed = dry_run(tmp_path, ["0, GPU-a, NVIDIA H200", "1, GPU-b, NVIDIA H100 80GB HBM3"],
                    "--cores", "2", "--resources", "gpu=2")
    said = mixed.stdout + mixed.stderr
    assert mixed.returncode != 0
    assert "this host's GPUs are of 2 models (NVIDIA H200: GPU 0; NVIDIA H100 80GB HBM3: GPU 1)" in said
    assert "rule calibrate_device" not in said
    same = dry_run(tmp_path, ["0, GPU-a, NVIDIA H200", "1, GPU-b, NVIDIA H200"],
                   "--cores", "2", "--resources", "gpu=2")
    assert same.returncode == 0, same.stderr[-3000:]
    text = same.stdout + same.stderr
    day = datetime.datetime.now(datetime.timezone.utc).date().isoformat()
    assert f"results/runs/nvidia-h200x2-{day}/" in text
    # Built once per host before the fan-out: the GPU jobs that wait for no calibration wait for the build.
    for rule in ("calibrate_device", "bench_kernels"):
        assert f"results/runs/nvidia-h200x2-{day}/build/kernels.json" in inputs_of(text, rule), rule


def test_snakefile_with_one_gpu_is_as_before(tmp_path):
    """gpu=1 on the same mixed host: no pool, no refusal, no build edge, the run folder by the first GPU's name."""
    one = dry_run(tmp_path, ["0, GPU-a, NVIDIA H200", "1, GPU-b, NVIDIA H100 80GB HBM3"],
                  "--cores", "1", "--resources", "gpu=1")
    assert one.returncode == 0, one.stderr[-3000:]
    text = one.stdout + one.stderr
    day = datetime.datetime.now(datetime.timezone.utc).date().isoformat()
    assert f"results/runs/nvidia-h200-{day}/" in text
    assert "build/kernels.json" not in inputs_of(text, "calibrate_device")
    assert inputs_of(text, "bench_kernels") == ""


def test_each_gpu_has_its_own_warm_worker(tmp_path):
    """With PKV_WORKER=on a GPU command goes to the warm worker of the GPU it took (the worker
    is keyed by the environment, CUDA_VISIBLE_DEVICES included): two GPUs, two workers."""
    env = pool_env(tmp_path, ["GPU-a", "GPU-b"], PKV_WORKER="on", PKV_WORKER_IDLE_S="3", TMPDIR=str(tmp_path))
    locks = Path(env["PKV_GPU_LOCKS"])
    for other in ("GPU-b", "GPU-a"):          # GPU-a's job while GPU-b is held, then the other way round
        held = gpu_pool._try_lock(locks / f"{other}.lock")
        try:
            done = subprocess.run([sys.executable, "-m", "pkv.cli", "measure", "--help"], env=env, cwd=REPO,
                                  capture_output=True, text=True, timeout=300)
        finally:
            held.close()
        assert done.returncode == 0 and "usage:" in done.stdout, done.stderr
    logs = sorted(tmp_path.glob("pkv-worker-*/*.log"))
    assert len(logs) == 2, logs
    for log in logs:
        text = log.read_text()
        assert text.count("rc=0") == 1 and "measure --help" in text, text


# ---------------------------------------------------------------- alone against N at once

FAKE_BENCH = textwrap.dedent("""
    import os, sys, time
    import pandas as pd
    from pkv.cli.gpu_pool import take
    gpu = take(["bench", "host"])
    open(sys.argv[1] + ".gpu", "w").write(gpu)
    time.sleep(0.5)
    slow = 1.0 if sys.argv[1].endswith("alone.parquet") else 1.5
    rows = int(os.environ.get("FAKE_ROWS", "2"))
    pd.DataFrame({"batch": list(range(1, rows + 1)), "engine": ["pkv-graph"] * rows,
                  "wall_us": [10.0 * slow] * rows, "mean_total_tokens": [1.0] * rows}).to_parquet(sys.argv[1])
""")


def test_contention_runs_alone_then_copies_on_their_own_gpus(tmp_path):
    from pkv.cli import contention

    ids = ["GPU-a", "GPU-b", "GPU-c"]
    env = pool_env(tmp_path, ids)
    out = tmp_path / "contention"
    done = subprocess.run([sys.executable, "-m", "pkv.cli.contention", "--copies", "3", "--out", str(out), "--",
                           sys.executable, "-c", FAKE_BENCH, "{out}"], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    assert sorted((out / f"copy-{i}.parquet.gpu").read_text() for i in (1, 2, 3)) == ids   # one GPU each
    table = (out / "contention.md").read_text()
    assert "| wall_us | 2 | 1.500 | 1.500 | batch=1, engine=pkv-graph |" in table, table
    assert "mean_total_tokens" not in table          # not a measured time
    (out / "copy-2.parquet").unlink()
    subprocess.run([sys.executable, "-c", FAKE_BENCH, str(out / "copy-2.parquet")], env={**env, "FAKE_ROWS": "3"},
                   check=True, timeout=120)
    with pytest.raises(ValueError, match="copy-2.parquet: not the rows of"):
        contention.compare(out / "alone.parquet", [out / f"copy-{i}.parquet" for i in (1, 2, 3)])


def test_contention_needs_the_output_placeholder(tmp_path):
    done = subprocess.run([sys.executable, "-m", "pkv.cli.contention", "--out", str(tmp_path), "--", "true"],
                          env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "{out}" in done.stderr


def test_the_host_pool_as_export_lines(tmp_path):
    """`python3 -m pkv.config.gpus`: this host's pool for commands run by hand; a mixed host is refused."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "nvidia-smi").write_text(FAKE_SMI.format(python=sys.executable))
    (bin_dir / "nvidia-smi").chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "TMPDIR": str(tmp_path), "PYTHONPATH": str(REPO)}
    env.pop("CUDA_VISIBLE_DEVICES", None)

    def export(gpus: str, **extra) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "pkv.config.gpus"], env={**env, "FAKE_GPUS": gpus, **extra},
                              capture_output=True, text=True, timeout=120)

    done = export("0, GPU-a, NVIDIA H200;1, GPU-b, NVIDIA H200")
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["export PKV_GPUS=GPU-a,GPU-b",
                                        f"export PKV_GPU_LOCKS={tmp_path}/pkv-gpus-{os.getuid()}"]
    mixed = export("0, GPU-a, NVIDIA H200;1, GPU-b, NVIDIA H100 80GB HBM3")
    assert mixed.returncode == 2 and "2 models" in mixed.stderr and not mixed.stdout
    assert export("0, GPU-a, NVIDIA H200;1, GPU-b, NVIDIA H100 80GB HBM3", CUDA_VISIBLE_DEVICES="1").stdout.startswith(
        "export PKV_GPUS=GPU-b\n")
