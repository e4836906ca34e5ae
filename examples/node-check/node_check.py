"""Check every node of a job before a long run: each GPU computes, each node reaches the others.

Every process (one per GPU, or a few on CPUs) multiplies two matrices on its device and checks
the product against a float64 reference on the CPU, times it (GFLOP/s), and allocates and
checks --mem-fraction of the device's memory. Then the processes sum their ranks with an
all-reduce, and every process exchanges a tensor with the process of the same local rank on
every other node, one pair of nodes at a time, all local ranks at once: on nodes with one
network card per GPU (rails), each rail is tested, and a bad or slow one is named by its two
nodes and its local rank. Rank 0 prints one line per process and per pair of nodes and local
rank, then "All N ranks on M nodes passed" (exit 0) or "FAILED: ..." lines (exit 1). A pair
slower than --slow-fraction of the median of all pairs fails too. Every wait is bounded by
--timeout, so that a
dead node ends the check instead of hanging it. Run it under torchrun (RANK, WORLD_SIZE,
LOCAL_RANK) or as one Slurm task per GPU (SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID), with
MASTER_ADDR and MASTER_PORT set; a node's name is SLURMD_NODENAME, else its host name.

    torchrun --standalone --nproc-per-node=2 node_check.py --device cpu
    sbatch node_check.sbatch                 # then the benchmark, on every GPU of two nodes
"""

import argparse
import datetime
import glob
import itertools
import os
import socket
import statistics
import sys
import time


def positive_int(text):
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer (got {text})")
    return int(text)


def non_negative_int(text):
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more (got {text})")
    return value


def fraction(text):
    try:
        value = float(text)
    except ValueError:
        value = None
    if value is None or not 0 < value <= 0.95:
        raise argparse.ArgumentTypeError(f"must be a number above 0 and at most 0.95 (got {text})")
    return value


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    parser.add_argument(
        "--matrix-size", type=positive_int, help="default: 8192 on GPUs, 512 on CPUs"
    )
    parser.add_argument("--iters", type=positive_int, default=10, help="timed matmuls")
    parser.add_argument(
        "--mem-fraction",
        type=fraction,
        help="of the GPU's memory, or of the node's memory per process on CPUs (mind the "
        "job's --mem); default: 0.5 on GPUs, 0.01 on CPUs",
    )
    parser.add_argument("--pair-bytes", type=positive_int, default=2**24, help="per pair")
    parser.add_argument(
        "--slow-fraction",
        type=fraction,
        default=0.5,
        help="a pair slower than this fraction of the median of all pairs fails",
    )
    parser.add_argument("--timeout", type=positive_int, default=60, help="seconds to wait")
    # Testing aids: make one rank compute a wrong product, one node (or one of its local ranks)
    # send wrong data, or one local rank's exchanges take a second longer.
    parser.add_argument(
        "--fail-rank", type=non_negative_int, help="testing aid: this rank computes wrongly"
    )
    parser.add_argument(
        "--fail-node", type=node_rail, help="testing aid: NODE[:LOCAL_RANK] sends wrong data"
    )
    parser.add_argument(
        "--slow-node", type=node_rail, help="testing aid: NODE[:LOCAL_RANK] is 1 s slower"
    )
    return parser.parse_args(argv)


def node_rail(text):
    """NODE or NODE:LOCAL_RANK, as (node, local rank or None)."""
    node, _, local = text.partition(":")
    if not node or (local and not local.isdecimal()):
        raise argparse.ArgumentTypeError(f"must be NODE or NODE:LOCAL_RANK (got {text!r})")
    return node, int(local) if local else None


def fail(message, code=2):
    print(f"node_check.py: error: {message}", file=sys.stderr)
    sys.exit(code)


# The scheduler's word that this job was given GPUs: lists of GPU indices ("0" is a GPU), then
# counts ("0" is none; the guide's .pbs scripts export JOB_GPUS from the job's request).
GPU_LIST_VARIABLES = ("SLURM_STEP_GPUS", "SLURM_JOB_GPUS", "SGE_HGR_gpu")
GPU_COUNT_VARIABLES = ("PBS_NGPUS", "JOB_GPUS")
GPU_DEVICE_FILES = ("/dev/nvidia[0-9]*", "/dev/kfd")
# Signs of an Apptainer/Singularity or Podman container (Docker passes no job variables in).
CONTAINER_VARIABLES = ("APPTAINER_CONTAINER", "SINGULARITY_CONTAINER", "container")
CONTAINER_FILES = ("/.singularity.d", "/run/.containerenv")


def gpus_given():
    """'NAME=value' of the first scheduler variable that gave this job GPUs, or None. Inside a
    Slurm step (srun), SLURM_JOB_GPUS is the job's, copied into every step: it does not count."""
    for name in GPU_LIST_VARIABLES + GPU_COUNT_VARIABLES:
        value = os.environ.get(name, "").strip()
        none = ("", "0") if name in GPU_COUNT_VARIABLES else ("", "(null)", "-1", "NoDevFiles")
        in_step = name == "SLURM_JOB_GPUS" and "SLURM_STEP_ID" in os.environ
        if value not in none and not in_step:
            return f"{name}={value}"
    return None


def gpu_usable(torch):
    """True when PyTorch can use a GPU. When it cannot in a job given GPUs, on a node with GPU
    device files or in a container (started without GPU support), stop in one line: a job given
    GPUs never trains on the CPU unnoticed. A bare CUDA_VISIBLE_DEVICES counts on a GPU node."""
    if torch.cuda.is_available():
        return True
    devices = any(glob.glob(pattern) for pattern in GPU_DEVICE_FILES)
    container = any(os.environ.get(name) for name in CONTAINER_VARIABLES) or any(
        os.path.exists(path) for path in CONTAINER_FILES
    )
    given = gpus_given() if devices or container else None
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").strip()
    if devices and not given and visible not in ("", "(null)", "-1", "NoDevFiles"):
        given = f"CUDA_VISIBLE_DEVICES={visible}"
    if given:
        fix = "run check_pytorch.py in the job to see why"
        if not devices:  # a container started without them
            fix = "start the container with GPU support (apptainer --nv, podman --gpus all)"
        fail(f"this job was given GPUs ({given}) but PyTorch {torch.__version__} can use none: "
             f"{fix}, or pass --device cpu")  # fmt: skip
    return False


def announce_gpu(torch, device):
    """One line per process that runs on a GPU: make site-check counts the GPUs that ran."""
    props = torch.cuda.get_device_properties(device)
    print(f"GPU in use: {props.uuid} ({props.name}) on {os.uname().nodename}", flush=True)


def gpu_index(local_rank, visible):
    """The GPU of this process, given how many it sees: its local rank's when it sees the GPUs
    of the whole node, device 0 when Slurm bound one GPU to the task (--gpus-per-task=1)."""
    if visible == 1:
        return 0
    if local_rank >= visible:
        fail(
            f"local rank {local_rank} but {visible} GPUs visible: request one GPU per process "
            "(--gpus-per-node equal to the processes per node, or --gpus-per-task=1)"
        )
    return local_rank


def distributed_env():
    """(rank, world size, local rank) from torchrun's variables, or else from srun's."""
    if "RANK" in os.environ or "SLURM_PROCID" not in os.environ:
        names = ("RANK", "WORLD_SIZE", "LOCAL_RANK")
    else:
        names = ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID")
    for name in (*names, "MASTER_ADDR", "MASTER_PORT"):
        if name not in os.environ:
            fail(f"{name} not set: start this script with torchrun or srun (node_check.sbatch)")
    for name in (*names, "MASTER_PORT"):
        if not os.environ[name].isdecimal():
            fail(f"{name}={os.environ[name]!r} is not a number")
    rank, world, local_rank = (int(os.environ[name]) for name in names)
    if not rank < world:
        fail(f"rank {rank} is outside a world of {world} processes ({names[0]}, {names[1]})")
    return rank, world, local_rank


def check_compute(torch, device, args, wrong=False):
    """Multiply two matrices of small integers: float32 computes their product exactly, so
    it must equal the float64 reference. Checking P x = A (B x) for a few vectors x costs n^2
    on the CPU instead of n^3 (Freivalds' check). Returns (problem or None, GFLOP/s)."""
    n = args.matrix_size
    generator = torch.Generator().manual_seed(0)
    a, b = (torch.randint(-4, 5, (n, n), generator=generator, dtype=torch.float64)
            for _ in range(2))  # fmt: skip
    a_dev, b_dev = a.to(device, torch.float32), b.to(device, torch.float32)
    product = a_dev @ b_dev  # warm-up, and the product that is checked
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(args.iters):
        torch.matmul(a_dev, b_dev, out=product)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    gflops = 2 * n**3 * args.iters / (time.perf_counter() - start) / 1e9
    if wrong:
        product[n // 2, n // 3] += 1  # --fail-rank: one wrong element, as a faulty GPU gives
    x = torch.randint(1, 9, (n, 2), generator=generator, dtype=torch.float64)
    rows = (product.cpu().double() @ x != a @ (b @ x)).any(dim=1)
    if rows.any():
        return f"matmul {n}x{n} wrong in {int(rows.sum())} of {n} rows", gflops
    return None, gflops


def check_memory(torch, device, args):
    """Allocate --mem-fraction of the device's memory, write a pattern, read it back.
    Returns (problem or None, GiB)."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
    else:
        free = total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    nbytes = int(args.mem_fraction * total)
    gib = nbytes / 2**30
    if nbytes > free:  # another process holds this GPU's memory
        return f"only {free / 2**30:.1f} GiB free of {total / 2**30:.1f} GiB", gib
    try:
        block = torch.empty(nbytes, dtype=torch.uint8, device=device)
        block.fill_(0xA5)
        # Compare in 256 MiB pieces: a comparison of the whole block would need as much again.
        bad = sum(int((piece != 0xA5).sum()) for piece in block.split(2**28))
    except (RuntimeError, MemoryError) as error:  # torch.OutOfMemoryError too
        return f"allocating {gib:.2f} GiB failed ({str(error).splitlines()[0]})", gib
    del block
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return (f"{bad} bytes read back wrong in {gib:.2f} GiB" if bad else None), gib


def check_pairs(torch, dist, device, hosts, rank, args):
    """Local rank k of each node exchanges --pair-bytes with local rank k of every other node:
    on a node with one network card per GPU, each card (rail) carries its own GPU's traffic.
    Node pair by node pair, in the same order everywhere (so no send waits for a later one),
    and all local ranks at once, as in training. Returns {(node, node, local rank): (problem
    or None, GB/s)} for the pairs this rank took part in."""
    nodes = list(dict.fromkeys(hosts))  # in the order of their first rank
    ranks_of = {node: [r for r, host in enumerate(hosts) if host == node] for node in nodes}
    local = ranks_of[hosts[rank]].index(rank)  # this rank's place on its node
    count = args.pair_bytes // 4 or 1
    results = {}
    for i, j in itertools.combinations(range(len(nodes)), 2):
        if hosts[rank] not in (nodes[i], nodes[j]):
            continue
        other = nodes[j] if hosts[rank] == nodes[i] else nodes[i]
        if local >= len(ranks_of[other]):  # the other node has fewer ranks
            continue
        peer = ranks_of[other][local]
        mine = torch.full((count,), float(rank + 1), device=device)
        if args.fail_node in ((hosts[rank], None), (hosts[rank], local)):
            mine[count // 2] = 0  # --fail-node: what this rank sends arrives wrong
        theirs = torch.empty(count, device=device)
        for _ in range(2):  # the first exchange also sets up the connection: time the second
            start = time.perf_counter()
            if args.slow_node in ((hosts[rank], None), (hosts[rank], local)):
                time.sleep(1)  # --slow-node: this rank's link is slow
            if hosts[rank] == nodes[i]:  # the lower node sends first, the higher one receives
                dist.send(mine, peer)
                dist.recv(theirs, peer)
            else:
                dist.recv(theirs, peer)
                dist.send(mine, peer)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
        gbps = 2 * count * 4 / (time.perf_counter() - start) / 1e9
        bad = int((theirs != peer + 1).sum())
        problem = f"{hosts[rank]} received wrong data from {other} ({bad} of {count})"
        results[(nodes[i], nodes[j], local)] = (problem if bad else None, gbps)
    return results


def summary(results, slow_fraction):
    """Rank 0's lines, made from every rank's results, and the failures among them."""
    lines, failures = [], []
    for r in results:
        problems = [p for p in (r["compute"], r["memory"], r["sum"]) if p]
        lines.append(
            f"rank {r['rank']} on {r['host']}, {r['device']}: {r['gflops']:.1f} "
            f"GFLOP/s, {r['gib']:.2f} GiB checked: {'; '.join(problems) or 'ok'}"
        )
        failures += [f"rank {r['rank']} on {r['host']}, {r['device']}: {p}" for p in problems]
    pairs = {}
    for r in results:  # both nodes of a pair report it: keep a problem and the higher speed
        for pair, (problem, gbps) in r["pairs"].items():
            old_problem, old_gbps = pairs.get(pair, (None, gbps))
            pairs[pair] = (old_problem or problem, max(old_gbps, gbps))  # less waiting
    median = statistics.median(gbps for _, gbps in pairs.values()) if pairs else 0
    for (a, b, local), (problem, gbps) in sorted(pairs.items()):
        if not problem and gbps < slow_fraction * median:  # a slow rail, link or card
            problem = (f"slow: {gbps:.2f} GB/s, under {slow_fraction:g} x the median of "
                       f"all pairs, {median:.2f} GB/s")  # fmt: skip
        lines.append(f"nodes {a} <-> {b}, local rank {local}: {gbps:.2f} GB/s: {problem or 'ok'}")
        failures += [f"nodes {a} <-> {b}, local rank {local}: {problem}"] if problem else []
    return lines, failures


def main(argv=None):
    args = parse_args(argv)
    rank, world, local_rank = distributed_env()
    import torch
    import torch.distributed as dist

    use_cuda = args.device == "cuda" or (args.device == "auto" and gpu_usable(torch))
    if use_cuda and not torch.cuda.is_available():
        fail("--device cuda but no GPU is visible: request GPUs (Slurm: --gpus-per-node=N, "
             "PBS: -l select=1:ncpus=4:ngpus=N, Grid Engine: -l gpu=N)")  # fmt: skip
    if use_cuda:
        device = torch.device("cuda", gpu_index(local_rank, torch.cuda.device_count()))
        torch.cuda.set_device(device)
        announce_gpu(torch, device)
        name = f"cuda:{device.index} {torch.cuda.get_device_name(device)}"
    else:
        device, name = torch.device("cpu"), "cpu"
    args.matrix_size = args.matrix_size or (8192 if use_cuda else 512)
    args.mem_fraction = args.mem_fraction or (0.5 if use_cuda else 0.01)
    host = os.environ.get("SLURMD_NODENAME") or socket.gethostname()

    # (a) compute, on this process's own: nothing here waits for the others
    compute, gflops = check_compute(torch, device, args, wrong=rank == args.fail_rank)
    memory, gib = check_memory(torch, device, args)

    # (b) communicate: each step waits at most --timeout for the others
    stage = f"the start (all {world} ranks reaching {os.environ['MASTER_ADDR']})"
    try:
        dist.init_process_group(
            "nccl" if use_cuda else "gloo",
            init_method="env://",  # MASTER_ADDR and MASTER_PORT
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=args.timeout),
            device_id=device if use_cuda else None,
        )
        stage = "the all-reduce of the ranks"
        total = torch.tensor([rank], dtype=torch.float64, device=device)
        dist.all_reduce(total)
        expected = world * (world - 1) // 2
        wrong_sum = f"sum of ranks {total.item():.0f}, not {expected}"
        total_problem = None if total.item() == expected else wrong_sum
        stage = "the exchange of host names"
        hosts = [None] * world
        dist.all_gather_object(hosts, host)
        stage = "the exchanges between nodes"
        pairs = check_pairs(torch, dist, device, hosts, rank, args)
        stage = "the gathering of the results"
        mine = dict(rank=rank, host=host, device=name, compute=compute, gflops=gflops,
                    memory=memory, gib=gib, sum=total_problem, pairs=pairs)  # fmt: skip
        results = [None] * world
        dist.all_gather_object(results, mine)
    except (RuntimeError, TimeoutError) as error:  # DistError, DistNetworkError too
        first_line = str(error).splitlines()[0] if str(error) else type(error).__name__
        fail(f"rank {rank} on {host}: {stage} did not complete within {args.timeout} s "
             f"({first_line})", code=1)  # fmt: skip
    lines, failures = summary(results, args.slow_fraction)
    if rank == 0:
        nodes = len({r["host"] for r in results})
        print(
            f"Node check: {world} ranks on {nodes} node(s), {dist.get_backend()}, "
            f"matmul {args.matrix_size}x{args.matrix_size}, timeout {args.timeout} s"
        )
        for line in lines:
            print(line)
        for failure in failures:
            print(f"FAILED: {failure}")
        if not failures:
            print(f"All {world} ranks on {nodes} node{'s' if nodes > 1 else ''} passed")
    dist.destroy_process_group()
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        print("node_check.py: interrupted (Ctrl-C)", file=sys.stderr)
        sys.exit(130)
