"""ddp_torchrun.pbs's launcher under the tests' OpenPBS complex: what each torchrun gets, how
many processes it starts, the port it meets on; and qrerun, which only an operator may use.

The jobs run on the complex of test_pbs.py (two nodes, pbs-n1 and pbs-n2, 2 ngpus each).
"""

import re
import subprocess
import sysconfig
from pathlib import Path

import pytest
from test_pbs import TRAIN, output_of, qsub, wait_for

from conftest import ROOT, TESTS, copy_example, run

SCRIPT = ROOT / "examples" / "ddp" / "ddp_torchrun.pbs"

# Stands in for ddp.py: each process says what torchrun and the job script gave it.
RANK_REPORT = """import glob, os, sys
files = glob.glob(os.path.join(os.getcwd(), ".ddp-torchrun.*.env"))
mode = oct(os.stat(files[0]).st_mode & 0o777) if files else "none"
e = os.environ
line = (f"rank {e['RANK']} of {e['WORLD_SIZE']} (node {e['GROUP_RANK']}, local {e['LOCAL_RANK']} "
        f"of {e['LOCAL_WORLD_SIZE']}): NCCL_SOCKET_IFNAME={e.get('NCCL_SOCKET_IFNAME')} "
        f"MY_SETTING={e.get('MY_SETTING')!r} JOB_GPUS={e.get('JOB_GPUS')} env file {mode} "
        f"in {os.getcwd()}")
# A file per rank: the output file interleaves the nodes' streams (the MoM relays node 2's).
with open(f"rank-{e['RANK']}.txt", "w") as out:
    out.write(line + "\\n")
"""


def with_lines_after_activate(script, *lines):
    """The job script with lines added after the venv's activation, as a reader adds exports."""
    text = script.read_text()
    anchor = 'source "$VENV/bin/activate"\n'
    assert text.count(anchor) == 1, text
    script.write_text(text.replace(anchor, anchor + "".join(f"{line}\n" for line in lines)))


def venv_with_path_first(tmp_path, env, folder):
    """A venv (the tests' own) whose activate puts folder first on PATH: the job script, on the
    first node, finds the programs in it."""
    venv = tmp_path / "venv-path"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "activate").write_text(
        f"source {env['VENV']}/bin/activate\nPATH={folder}:$PATH\n"
    )
    return venv


def shared_python(folder):
    """An EasyBuild-style python in folder: bin/python3.X, a launcher (Py_BytesMain) that needs
    lib/libtestpython.so and has no RPATH, so that it starts only when LD_LIBRARY_PATH names
    lib/ (module load python/3.11-shared). libtestpython.so wraps this interpreter's libpython.
    (Not libpython itself, copied: Debian's own libpython3.X.so.1.0 is in the loader's cache
    and would be found without LD_LIBRARY_PATH.) lib/python3.X is this interpreter's stdlib."""
    config = sysconfig.get_config_vars()
    if not config.get("Py_ENABLE_SHARED"):
        pytest.skip("this Python has no shared libpython to build the module stand-in from")
    if subprocess.run(["which", "gcc"], capture_output=True).returncode:
        pytest.skip("gcc is not installed (OpenPBS's build needs it too)")
    version = config["VERSION"]
    (folder / "bin").mkdir(parents=True)
    (folder / "lib").mkdir()
    (folder / "lib" / f"python{version}").symlink_to(Path(sysconfig.get_path("stdlib")))
    (folder / "wrap.c").write_text(
        "#include <Python.h>\n"
        "int test_python_main(int argc, char **argv) { return Py_BytesMain(argc, argv); }\n"
    )
    (folder / "main.c").write_text(
        "int test_python_main(int argc, char **argv);\n"
        "int main(int argc, char **argv) { return test_python_main(argc, argv); }\n"
    )
    libdir = config["LIBDIR"]
    run(["gcc", "-shared", "-fPIC", f"-I{config['INCLUDEPY']}", "wrap.c", "-o",
         "lib/libtestpython.so", f"-L{libdir}", f"-lpython{version}", f"-Wl,-rpath,{libdir}"],
        cwd=folder)  # fmt: skip
    run(["gcc", "main.c", "-o", f"bin/python{version}", "-Llib", "-ltestpython"], cwd=folder)
    return folder / "bin" / f"python{version}"


def venv_of_shared_python(tmp_path, env):
    """(the python/3.11-shared stand-in's folder, a venv made from it that sees the tests' venv's
    packages, with a torchrun that runs on its python)."""
    home = tmp_path / "shared-python"
    python = shared_python(home)
    proc = subprocess.run([python, "-c", "1"], capture_output=True, text=True)
    assert "error while loading shared libraries: libtestpython.so" in proc.stderr, proc.stderr
    venv = tmp_path / "venv-shared"
    with_lib = {**env, "LD_LIBRARY_PATH": str(home / "lib")}
    run([python, "-m", "venv", "--without-pip", venv], cwd=tmp_path, env=with_lib)
    packages = Path(sysconfig.get_path("purelib", vars={"base": env["VENV"]}))
    version = sysconfig.get_config_var("VERSION")
    site = venv / "lib" / f"python{version}" / "site-packages"
    (site / "tests-venv.pth").write_text(f"{packages}\n")
    (venv / "bin" / "torchrun").write_text(
        f"#!{venv}/bin/python\nimport sys\n"
        "from torch.distributed.run import main\nsys.exit(main())\n"
    )
    (venv / "bin" / "torchrun").chmod(0o755)
    check = run([venv / "bin" / "python", "-c", "import torch; print(torch.__version__)"],
                cwd=tmp_path, env=with_lib)  # fmt: skip
    assert check.stdout.strip(), check
    return home, venv


@pytest.mark.pbs
def test_ddp_runs_with_a_module_python_that_needs_ld_library_path(complex_env, tmp_path):
    """ddp.md: an EasyBuild python module (libpython found through LD_LIBRARY_PATH only) and a
    venv made from it. The torchruns that pbs_tmrsh starts on both nodes run in the job
    script's environment, the module's LD_LIBRARY_PATH included, and train: a launcher that
    passed only PATH and VIRTUAL_ENV failed on every node with "error while loading shared
    libraries"."""
    home, venv = venv_of_shared_python(tmp_path, complex_env)
    copy_example(tmp_path, "ddp/ddp_torchrun.pbs", "ddp/ddp.py")
    script = tmp_path / "ddp_torchrun.pbs"
    text, count = re.subn(r"^module load python/3\.11\b", "module load python/3.11-shared",
                          script.read_text(), flags=re.M)  # fmt: skip
    assert count == 1, text
    script.write_text(text)
    env = {**complex_env, "VENV": str(venv)}
    job = qsub("ddp_torchrun.pbs", args=TRAIN, cwd=tmp_path, env=env,
               extra={"SHARED_PYTHON": home})  # fmt: skip
    record = wait_for(job, env, timeout=240)
    output = output_of(tmp_path, "ddp-torchrun", job)
    assert "error while loading shared libraries" not in output, output
    assert record.get("Exit_status") == 0, output
    assert f"Job {job}: 2 node(s) x 2 processes" in output, output
    assert "4 processes, cpu (gloo), global batch 256" in output and "epoch 2: loss " in output


@pytest.mark.pbs
def test_every_rank_gets_what_the_job_script_exports(complex_env, tmp_path):
    """The NCCL_* setting and a variable of the reader's own, exported in the job script,
    reach all four processes on both nodes, which start in the job's folder. The environment
    travels in a file that only the user can read, gone once the job has ended."""
    copy_example(tmp_path, "ddp/ddp_torchrun.pbs")
    (tmp_path / "ddp.py").write_text(RANK_REPORT)
    exports = ("export NCCL_SOCKET_IFNAME=lo", "export MY_SETTING='two words'")
    with_lines_after_activate(tmp_path / "ddp_torchrun.pbs", *exports)
    job = qsub("ddp_torchrun.pbs", cwd=tmp_path, env=complex_env)
    record = wait_for(job, complex_env, timeout=180)
    output = output_of(tmp_path, "ddp-torchrun", job)
    assert record.get("Exit_status") == 0, output
    lines = "".join(path.read_text() for path in sorted(tmp_path.glob("rank-*.txt")))
    ranks = re.findall(
        r"^rank (\d) of 4 \(node (\d), local \d of 2\): NCCL_SOCKET_IFNAME=lo "
        rf"MY_SETTING='two words' JOB_GPUS=4 env file 0o600 in {re.escape(str(tmp_path))}$",
        lines, re.M)  # fmt: skip
    assert sorted(ranks) == [("0", "0"), ("1", "0"), ("2", "1"), ("3", "1")], output + lines
    assert not list(tmp_path.glob(".ddp-torchrun.*")), list(tmp_path.iterdir())


@pytest.mark.pbs
def test_a_job_whose_gpus_come_with_the_node_counts_them(complex_env, tmp_path):
    """Polaris (select=N:system=polaris) and ABCI 3.0 (-q rt_HF -l select=N) name no ngpus:
    the script counts the first node's GPUs with nvidia-smi -L (the stand-in shows 3) and
    starts that many processes on each node."""
    copy_example(tmp_path, "ddp/ddp_torchrun.pbs")
    (tmp_path / "ddp.py").write_text(RANK_REPORT)
    standins = tmp_path / "standins"
    standins.mkdir()
    (standins / "nvidia-smi").symlink_to(TESTS / "standins" / "nvidia-smi")
    env = {**complex_env, "VENV": str(venv_with_path_first(tmp_path, complex_env, standins))}
    job = qsub("ddp_torchrun.pbs", "-l", "select=2:ncpus=8:mem=32gb", cwd=tmp_path, env=env,
               extra={"NVIDIA_SMI_GPUS": "3"})  # fmt: skip
    record = wait_for(job, env, timeout=180)
    output = output_of(tmp_path, "ddp-torchrun", job)
    assert record.get("Exit_status") == 0, output
    assert f"Job {job}: 2 node(s) x 3 processes" in output, output
    lines = "".join(path.read_text() for path in sorted(tmp_path.glob("rank-*.txt")))
    ranks = re.findall(r"^rank (\d) of 6 \(node (\d), local \d of 3\): .* JOB_GPUS=6 ", lines, re.M)
    assert sorted(ranks) == [(str(r), str(r // 3)) for r in range(6)], output + lines


# PBS's own ports on an execution host, by default: the server (15001), the MoM (15002, 15003),
# the scheduler (15004), the data service (15007), and 15005-15006; the comm (17001).
PBS_PORTS = {*range(15001, 15008), 17001}


def ports_pbs_would_refuse(line):
    """The job numbers 0-9999 (the port repeats every 10000) whose rendezvous port, as the
    script's line computes it in bash, PBS uses or lies outside 1024-32767 (Linux hands out
    32768 on for outgoing connections): {job: port}."""
    loop = f'for job in {{0..9999}}; do {line}; echo "$job $RDZV_PORT"; done'
    out = subprocess.run(["bash", "-c", loop], capture_output=True, text=True, check=True).stdout
    ports = dict(map(int, row.split()) for row in out.splitlines())
    assert len(ports) == 10000, out[-500:]
    refused = {job: port for job, port in ports.items() if port in PBS_PORTS}
    return refused | {job: port for job, port in ports.items() if not 1024 <= port < 32768}


def test_no_job_number_derives_a_port_that_pbs_uses():
    """ddp_torchrun.pbs's rendezvous port, from the job number: never one of PBS's ports (the
    MoM's 15002 and 15003 are bound on every node, the first node included). The old formula,
    15000 + job % 10000, gave them to every job number ending in 2 or 3 (mod 10000)."""
    line = re.search(r"^RDZV_PORT=.*$", SCRIPT.read_text(), re.M)
    assert line, "ddp_torchrun.pbs sets no RDZV_PORT"
    assert ports_pbs_would_refuse(line[0]) == {}
    old = ports_pbs_would_refuse("RDZV_PORT=$((15000 + job % 10000))")
    assert {2: 15002, 3: 15003, 1: 15001, 2001: 17001} == {j: old[j] for j in (1, 2, 3, 2001)}


def test_the_complex_listens_on_no_port_that_a_test_job_derives():
    """tests/pbs/complex.sh's ports: none in 15000-29999 (the rendezvous ports of the Slurm
    and PBS test jobs that run beside it), 7000-9000 (the Slurm cluster's daemons) or on Grid
    Engine's 6444 and 6445, and none where Linux picks ports for connections (32768 on)."""
    text = (TESTS / "pbs" / "complex.sh").read_text()
    assigned = re.search(r"^SERVER_PORT=(\d+) DATA_PORT=(\d+) COMM=pbs-n1:(\d+)\n"
                         r"MOM1_PORT=(\d+) MOM2_PORT=(\d+)", text, re.M)  # fmt: skip
    assert assigned, "complex.sh: its port line changed; update this test"
    server, data, comm, mom1, mom2 = map(int, assigned.groups())
    ports = {server, data, comm, mom1, mom1 + 1, mom2, mom2 + 1}  # each MoM's manager port: +1
    taken = [p for p in ports if 15000 <= p < 30000 or 7000 <= p <= 9000 or p in (6444, 6445)]
    assert not taken and max(ports) < 32768, sorted(ports)


@pytest.mark.pbs
def test_qrerun_is_refused_to_a_user_who_is_not_an_operator(complex_env):
    """pbs.md: qrerun needs PBS Manager or Operator privilege (qrerun.1B); a job's owner has no
    equivalent but qdel and qsub again. User nobody submits a job (held) and may delete it, but
    qrerun of it is refused. (The complex's manager is root. nobody gets the two capabilities
    that a site's setuid pbs_iff and readable PBS_EXEC stand for: the tests' OpenPBS lives
    under /root, and its pbs_iff is not setuid.)"""
    caps = "+net_bind_service,+dac_read_search"
    conf = f"PBS_CONF_FILE={complex_env['PBS_CONF_FILE']}"
    nobody = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", f"--inh-caps={caps}",
              f"--ambient-caps={caps}", "--", "env", conf]  # fmt: skip
    bin_dir = Path(complex_env["PBS_EXEC"]) / "bin"

    def as_nobody(command, *args, stdin=None):
        return subprocess.run([*nobody, bin_dir / command, *args], input=stdin, cwd="/",
                              capture_output=True, text=True, timeout=60)  # fmt: skip

    submitted = as_nobody("qsub", "-h", "-N", "not-an-operator", stdin="sleep 1\n")
    assert submitted.returncode == 0, submitted
    job = submitted.stdout.strip()
    try:
        owner = run(["qstat", "-f", job], cwd="/", env=complex_env).stdout
        assert re.search(r"Job_Owner = nobody@", owner), owner
        refused = as_nobody("qrerun", job)
        assert refused.returncode != 0 and "Unauthorized Request" in refused.stderr, refused
        deleted = as_nobody("qdel", job)
        assert deleted.returncode == 0, deleted
    finally:
        run(["qdel", "-W", "force", job], cwd="/", env=complex_env, expect_rc=None)


def test_the_launcher_runs_on_el7_tools():
    """EL7 nodes, still at some PBS sites, have bash 4.2 and coreutils 8.22: ddp_torchrun.pbs
    uses nothing newer (`wait -n` and namerefs are bash 4.3, `${x@Q}` and `mapfile -d` 4.4,
    `env -C` coreutils 8.28). test_a_failed_torchrun_stops_the_other_nodes_and_the_job
    (test_pbs.py) runs the loop that replaces `wait -n`."""
    code = "\n".join(line.split(" #")[0] for line in SCRIPT.read_text().splitlines()
                     if not line.lstrip().startswith("#"))  # fmt: skip
    newer = [r"\bwait\s+-n\b", r"\bdeclare\s+-n\b", r"@Q\}", r"\b(mapfile|readarray)\s+-d\b",
             r"\benv\s+(-C|--chdir)\b"]  # fmt: skip
    assert [p for p in newer if re.search(p, code)] == [], code
