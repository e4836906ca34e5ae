"""A centre's job scripts, generated from the generic ones in examples/ and its site file.

    python3 edition/generate.py site.toml OUTPUT_DIR      (make edition SITE=site.toml)

writes a copy of examples/ into OUTPUT_DIR/examples/ in which every script of the centre's
scheduler (and every setup script) has its site-specific blocks filled in from the site file,
with nothing left to uncomment. Compare with `diff -ru examples OUTPUT_DIR/examples`.

What changes, and nothing else:
- the lines between each block's markers: ``# --- Site-specific: ...`` and the line of dashes
  that closes it. Each line of a block matches one rule of RULES below (the account line, the
  partition line, the module lines, VENV=..., the node-local folder, ...) and is replaced by the
  centre's lines; comments are kept. A line no rule knows stops the generation, naming the file
  and line, so that a new script cannot escape its centre's values;
- outside the blocks, the GPU request (``#SBATCH --gpus-per-node=N``) in the centre's form, and
  where the site file sets cores_per_gpu or memory_per_gpu, the cores and memory of GPU jobs.

PBS job scripts (.pbs) keep every site-specific directive in their first block: the project
(``##PBS -P``), the queue (``##PBS -q``) and the chunk (``#PBS -l select=N:ncpus=C:ngpus=G``),
each with its comment on the line above (PBS refuses a comment after a directive). The chunk
keeps its count, cores and memory and asks for its GPUs in the centre's form, or, where the
queues set the chunks' resources (scheduler.queue_resources), names only its count.

Job scripts of the other schedulers are copied unchanged. Standard library only.
"""

import re
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sitefile import SiteFileError, load  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
OPENING = re.compile(r"^# --- Site-specific\b.*$")
CLOSING = re.compile(r"^# -{20,}$")
WIDTH = 80  # of the marker lines
COMMENT_COLUMN = 37  # where the comments of generated #SBATCH lines start, as in the examples


class GenerateError(Exception):
    """One line, naming the file and the line."""


def scheduler_of(path):
    return {".sbatch": "slurm", ".qsub": "gridengine", ".pbs": "pbs"}.get(Path(path).suffix)


def split_comment(line):
    """(code, comment, column of the comment) of a line; comment is '' when there is none."""
    match = re.match(r"^(\S.*?)(\s+)(#(?!#?SBATCH|#?PBS|\$).*)$", line)
    if not match or line.startswith("# "):
        return line.rstrip(), "", None
    return match[1], match[3], len(match[1]) + len(match[2])


def with_comment(code, comment, column=None):
    if not comment:
        return code
    column = column or COMMENT_COLUMN
    return f"{code.ljust(column - 1)} {comment}" if len(code) < column else f"{code}  {comment}"


class Context:
    """What the rules need to know about one file."""

    def __init__(self, site, text):
        self.site = site
        # GPUs per node, from the request in the header or in a site-specific block.
        gpus = re.search(r"^#SBATCH --gpus-per-node=(\d+)", text, re.M)
        self.gpus = int(gpus[1]) if gpus else 0
        # Tasks per node: --ntasks-per-node, or --ntasks on one node, else one.
        tasks = re.search(r"^#SBATCH --ntasks-per-node=(\d+)", text, re.M)
        single = re.search(r"^#SBATCH --nodes=1\b", text, re.M) and re.search(
            r"^#SBATCH --ntasks=(\d+)", text, re.M
        )
        self.tasks = int(tasks[1]) if tasks else int(single[1]) if single else 1
        # PBS: the chunks of -l select=N:...:ngpus=G, and G, the GPUs of each.
        chunk = re.search(r"^#PBS -l select=(\d+)((?::\w+=[\w.]+)*)$", text, re.M)
        self.chunks = int(chunk[1]) if chunk else 1
        if chunk and (pbs_gpus := re.search(r":ngpus=(\d+)", chunk[2])):
            self.gpus = int(pbs_gpus[1])
        self.gpu_job = bool(self.gpus or re.search(r"^#\$ -l gpu=\d+", text, re.M))

    @property
    def per_gpu_cores(self):
        """True when the job asks for its cores with --cpus-per-gpu (scheduler.per_gpu)."""
        return bool(self.site.get("scheduler.per_gpu") and self.gpus)

    @property
    def partition(self):
        key = "gpu_partition" if self.gpu_job else "cpu_partition"
        if self.site.scheduler == "pbs" and self.gpu_job and self.site.get("scheduler.node_queue"):
            if self.site.pbs_queue(self.gpus, self.chunks) == self.site.get("scheduler.node_queue"):
                key = "node_queue"
        return self.site.get(f"scheduler.{key}"), f"scheduler.{key}"


def site_lines(values, make, comment, column):
    """One line per value, the generic line's comment on the last."""
    lines = [make(value) for value in values]
    if lines:
        lines[-1] = with_comment(lines[-1], comment, column)
    return lines


# Each rule: (pattern of a block line, function(context, match, comment, column) -> lines).
# A function returns the centre's lines; None keeps the line as it is.
def _account(ctx, m, comment, col):
    """The account, the QoS where the site makes every job name one, and the site's own
    directives for every job and for this kind of job."""
    lines = []
    for key, option in (("account", "--account"), ("qos", "--qos")):
        if value := ctx.site.get(f"scheduler.{key}"):
            lines.append(with_comment(f"#SBATCH {option}={value}", f"# site.toml: scheduler.{key}",
                                      col))  # fmt: skip
    for key, directive in ctx.site.directives(ctx.gpu_job):
        lines.append(with_comment(f"#SBATCH {directive}", f"# site.toml: scheduler.{key}", col))
    return lines


def _partition(ctx, m, comment, col):
    partition, key = ctx.partition
    if not partition:
        return []
    return [with_comment(f"#SBATCH --partition={partition}", f"# site.toml: {key}", col)]


def _gpus(ctx, m, comment, col):
    if ctx.site.scheduler == "gridengine":  # Grid Engine reads a comment as more options
        return [f"#$ {ctx.site.gpu_request(m['n'])}"]
    return [
        with_comment(f"#SBATCH {ctx.site.gpu_request(m['n'])}", "# site.toml: scheduler.gpus", col)
    ]


def _pbs_project(ctx, m, comment, col):
    """The project (-P), then the site's own directives for every job and for this kind of
    job. PBS reads no comment after a directive: each line's comment is on the line above."""
    lines = [REPLACES_COMMENT]
    if value := ctx.site.get("scheduler.account"):
        lines += ["# The project charged (site.toml: scheduler.account):", f"#PBS -P {value}"]
    for key, directive in ctx.site.directives(ctx.gpu_job):
        lines += [f"# site.toml: scheduler.{key}", f"#PBS {directive}"]
    return lines if len(lines) > 1 else []


def _pbs_queue(ctx, m, comment, col):
    queue, key = ctx.partition
    if not queue:
        return []
    what = {"scheduler.cpu_partition": "CPU jobs", "scheduler.gpu_partition": "GPU jobs",
            "scheduler.node_queue": "whole nodes"}[key]  # fmt: skip
    return [REPLACES_COMMENT, f"# The queue of {what} (site.toml: {key}):", f"#PBS -q {queue}"]


def pbs_chunk(site, count, resources):
    """A PBS chunk request, select=count plus resources (":ncpus=8:ngpus=2:mem=32gb"), as the
    site asks: the GPUs in its form, the cores and memory per GPU where it sets them; only the
    count where its queues set the rest. Returns (the request, the keys that changed it)."""
    if site.get("scheduler.queue_resources"):
        return f"select={count}", ["scheduler.queue_resources"]
    found = re.search(r":ngpus=(\d+)", resources)
    gpus = int(found[1]) if found else 0
    cores = site.get("scheduler.cores_per_gpu")
    memory = site.get("scheduler.memory_per_gpu")
    parts, keys = [str(count)], []
    for resource in filter(None, resources.split(":")):
        name, value = resource.split("=", 1)
        if name == "ngpus":
            resource, key = site.gpu_request(value), "gpus"
        elif name == "ncpus" and gpus and cores:
            resource, key = f"ncpus={cores * gpus}", "cores_per_gpu"
        elif name == "mem" and gpus and memory:  # 64G per GPU: 128gb for two
            resource, key = f"mem={int(memory[:-1]) * gpus}{memory[-1].lower()}b", "memory_per_gpu"
        else:
            key = None
        parts.append(resource)
        keys += [f"scheduler.{key}"] if key and resource != f"{name}={value}" else []
    return f"select={':'.join(parts)}", keys


def _pbs_chunk(ctx, m, comment, col):
    """The chunk as the site asks (pbs_chunk). The comment above says what the job needs; a
    line under it names the keys that changed the chunk. Where the queues set the cores, GPUs
    and memory, a comment of its own says so."""
    request, keys = pbs_chunk(ctx.site, m["n"], m["resources"])
    if not keys:
        return None
    if keys == ["scheduler.queue_resources"]:
        chunks = "One chunk" if m["n"] == "1" else f"{m['n']} chunks"
        return [REPLACES_COMMENT, f"# {chunks}, whose cores, GPUs and memory the queue sets "
                "(site.toml: scheduler.queue_resources):", f"#PBS -l {request}"]  # fmt: skip
    return [f"# site.toml: {', '.join(keys)}", f"#PBS -l {request}"]


def _optional_directive(key, make):
    def rule(ctx, m, comment, col):
        value = ctx.site.get(key)
        return [with_comment(make(value, m), f"# site.toml: {key}", col)] if value else []

    return rule


REPLACES_COMMENT = object()  # first of a rule's lines: they replace the comment above the line


def _pe(ctx, m, comment, col):
    """Slots in the site's parallel environment; where a site has none, its resource types
    name the cores: a GPU job's come with its GPUs, a CPU job asks for the CPU resource."""
    if pe := ctx.site.get("scheduler.parallel_environment"):
        return [f"#$ -pe {pe} {m['n']}"]
    cpu = ctx.site.get("scheduler.cpu_resource")
    if cpu and not ctx.gpu_job:  # in place of the comment on slots
        return [REPLACES_COMMENT, "# The site's resource for a CPU job:", f"#$ {cpu}"]
    return []


def _modules(key, keep_when_unset=True):
    def rule(ctx, m, comment, col):
        modules = ctx.site.get(key)
        if modules is None:
            return None if keep_when_unset else []
        return site_lines(modules, lambda name: f"module load {name}", comment, col)

    return rule


def _init(ctx, m, comment, col):
    files = ctx.site.get("modules.init", [])
    return site_lines(files, lambda path: f"source {path}", comment, col)


def _assign(key, template, keep_when=None):
    """VAR=... from the site file's key; None (keep the line) when the key is not set."""

    def rule(ctx, m, comment, col):
        value = ctx.site.get(key)
        if value is None or value == keep_when:
            return None
        return [with_comment(template.format(value=value, **m.groupdict()), comment, col)]

    return rule


def _cuda(ctx, m, comment, col):
    """The CUDA toolkit's module; CUDA_MODULE="" where a site has none (nvcc from PATH)."""
    value = ctx.site.get("modules.cuda")
    if value is None:
        return None
    return [with_comment(f'CUDA_MODULE="{value}"' if value == "" else f"CUDA_MODULE={value}",
                         comment, col)]  # fmt: skip


def _bind(ctx, m, comment, col):
    """The folders a container binds: the site's project, scratch and datasets."""
    keys = ("storage.project", "storage.scratch", "storage.data")
    folders = ",".join(value for key in keys if (value := ctx.site.get(key)))
    return [with_comment(f"BIND=${{BIND-{folders}}}", comment, col)]


RULES = [
    # Slurm directives of the first block
    (r"##SBATCH --account=\S+", _account),
    (r"##SBATCH --partition=\S+", _partition),
    (r"#SBATCH --gpus-per-node=(?P<n>\d+)", _gpus),
    # An optional GPU (a CPU job that may use one): the edition keeps the job a CPU job. Asking
    # for a GPU takes the GPU partition, cores and memory too, which the reader then sets.
    (r"##SBATCH --gpus-per-node=(?P<n>\d+)", lambda *_: []),
    (
        r"##SBATCH --tmp=(?P<size>\S+)",
        _optional_directive("scheduler.local_disk", lambda v, m: f"#SBATCH --tmp={m['size']}"),
    ),
    (
        r"##SBATCH --constraint=\S+",
        _optional_directive("scheduler.gpu_constraint", lambda v, m: f"#SBATCH --constraint={v}"),
    ),
    # Grid Engine directives
    (r"#\$ -pe \S+ (?P<n>\d+)", _pe),
    (r"#\$ -l gpu=(?P<n>\d+)", _gpus),
    # PBS directives: each comment is on the line above
    (r"##PBS -P \S+", _pbs_project),
    (r"#?#PBS -q \S+", _pbs_queue),  # commented out in the generic scripts: few sites have workq
    (r"#PBS -l select=(?P<n>\d+)(?P<resources>(?::\w+=[\w.]+)*)", _pbs_chunk),
    # modules
    (r"source /etc/profile\.d/modules\.sh", _init),
    (r"module load python/\S+", _modules("modules.python")),
    (r"module load gcc/\S+", _modules("modules.compiler")),
    (r"module load miniconda3\S*", _modules("modules.conda")),
    (r"module load apptainer/\S+", _modules("modules.apptainer")),
    (r"CUDA_MODULE=\S+", _cuda),
    # the environment
    (r"VENV=\$\{VENV:-[^}]+\}", _assign("environment.venv", "VENV=${{VENV:-{value}}}")),
    (
        r"CONDA_ENV=\$\{CONDA_ENV:-[^}]+\}",
        _assign("environment.conda_env", "CONDA_ENV=${{CONDA_ENV:-{value}}}"),
    ),
    (
        r"TORCH_BUILD=\$\{TORCH_BUILD:-\w+\}",
        _assign("pytorch.build", "TORCH_BUILD=${{TORCH_BUILD:-{value}}}", keep_when="default"),
    ),
    (
        r"TORCH_INDEX=\$\{TORCH_INDEX:-[^}]*\}",
        _assign("pytorch.index_url", "TORCH_INDEX=${{TORCH_INDEX:-{value}}}"),
    ),
    (r"WHEELHOUSE=\$\{WHEELHOUSE:-\}", lambda *_: None),
    # storage
    (
        r"LOCAL=\$\{SLURM_TMPDIR:-\$\{TMPDIR:-/tmp\}\}",
        _assign("storage.node_local", "LOCAL=${{{value}:-/tmp}}"),
    ),
    (
        r"export APPTAINER_TMPDIR=\$\{SLURM_TMPDIR:-/tmp\}(?P<rest>/\S+)",
        _assign("storage.node_local", "export APPTAINER_TMPDIR=${{{value}:-/tmp}}{rest}"),
    ),
    (
        r"CHECKPOINT_ROOT=\$\{CHECKPOINT_ROOT:-\$\{SCRATCH:-\$HOME/scratch\}/checkpoints\}",
        _assign("storage.scratch", "CHECKPOINT_ROOT=${{CHECKPOINT_ROOT:-{value}/checkpoints}}"),
    ),
    (
        r"CHECKPOINTS=\$\{SCRATCH:-\$PWD\}(?P<rest>/\S+)",
        _assign("storage.scratch", "CHECKPOINTS={value}{rest}"),
    ),
    (
        r"SHARDS=\$\{SHARDS:-shards\}",
        _assign("storage.project", "SHARDS=${{SHARDS:-{value}/shards}}"),
    ),
    (
        r"SHARED=\$\{SHARED:-compile-cache\}",
        _assign("storage.project", "SHARED=${{SHARED:-{value}/compile-cache}}"),
    ),
    # torch.compile's caches (cache_env.sh): node-local or fast storage of the user's own, which
    # a site file does not name (node_local is a job's own folder, emptied after it): kept.
    (r"COMPILE_DIR=\$\{COMPILE_DIR:-/tmp/torch-compile-\$USER\}", lambda *_: None),
    (
        r"PROJECT_DIR=\$\{PROJECT_DIR:-[^}]+\}",
        _assign("storage.project", "PROJECT_DIR=${{PROJECT_DIR:-{value}}}"),
    ),
    (
        r"LOGIN_HOST=\$\{LOGIN_HOST:-[^}]+\}",
        _assign("centre.login_host", "LOGIN_HOST=${{LOGIN_HOST:-{value}}}"),
    ),
    # the image a reader builds: in project space, not in a home with its small quota
    (
        r"IMAGE=\$\{IMAGE:-\$HOME/containers/pytorch\.sif\}",
        _assign("storage.project", "IMAGE=${{IMAGE:-{value}/containers/pytorch.sif}}"),
    ),
    (r"BIND=\$\{BIND-[^}]*\}", _bind),
    (
        r"export APPTAINER_CACHEDIR=\$\{APPTAINER_CACHEDIR:-\$APPTAINER_TMPDIR/cache\}",
        lambda *_: None,
    ),
]
RULES = [(re.compile(pattern), rule) for pattern, rule in RULES]


def fill_block(ctx, name, lineno, lines):
    out = []
    for offset, line in enumerate(lines):
        if line.startswith("#") and not re.match(r"^#(#?SBATCH|#?PBS|\$)", line):
            out.append(line)  # a comment, kept
            continue
        code, comment, column = split_comment(line)
        for pattern, rule in RULES:
            match = pattern.fullmatch(code)
            if match:
                lines_for_site = rule(ctx, match, comment, column)
                replaces = bool(lines_for_site) and lines_for_site[0] is REPLACES_COMMENT
                if replaces:
                    lines_for_site = lines_for_site[1:]
                previous = out[-1] if out and offset else None
                if (lines_for_site == [] or replaces) and previous == lines[offset - 1]:
                    if out[-1].startswith("# "):  # the comment that explained the line
                        out.pop()
                out.extend([line] if lines_for_site is None else lines_for_site)
                break
        else:
            raise GenerateError(
                f"{name}:{lineno + offset + 1}: a line of a site-specific block that "
                f"edition/generate.py has no rule for: {line.strip()}"
            )
    if ctx.per_gpu_cores and any(re.match(r"##SBATCH --account=", line) for line in lines):
        # --cpus-per-gpu sets SLURM_CPUS_PER_GPU, not the SLURM_CPUS_PER_TASK that the script
        # reads (srun -c, threads): the cores of one task, from the cores per GPU.
        out.append(
            "export SLURM_CPUS_PER_TASK=${SLURM_CPUS_PER_TASK:-$((SLURM_CPUS_PER_GPU * "
            f"{ctx.gpus} / {ctx.tasks}))}}  # site.toml: scheduler.per_gpu"
        )
        out.append("unset SLURM_CPUS_PER_GPU     # else srun reads it: its cores come from -c")
    if ctx.site.scheduler == "gridengine" and any(line.startswith("#$ ") for line in lines):
        last = max((i for i, line in enumerate(out) if line.startswith("#$ ")),
                   default=len(out) - 1)  # fmt: skip
        partition, _key = ctx.partition
        extra = [f"#$ -q {partition}"] if partition else []
        for key, option in (("account", "-P"), ("group", "-g")):
            if value := ctx.site.get(f"scheduler.{key}"):
                extra.append(f"#$ {option} {value}")
        extra += [f"#$ {directive}" for _key, directive in ctx.site.directives(ctx.gpu_job)]
        out[last + 1 : last + 1] = extra
    return out


def opening_marker(site):
    text = f"# --- Site-specific: {site.name}, generated from site.toml "
    return text + "-" * max(3, WIDTH - len(text))


def header_lines(ctx, lines):
    """Outside the blocks: the GPU request; cores and memory per GPU where the site sets them."""
    gpus, tasks = ctx.gpus, ctx.tasks
    if ctx.site.scheduler != "slurm" or not gpus:
        return lines
    per_gpu = ctx.site.get("scheduler.per_gpu")
    cores, memory = (
        ctx.site.get("scheduler.cores_per_gpu"),
        ctx.site.get("scheduler.memory_per_gpu"),
    )
    out = []
    for line in lines:
        code, comment, column = split_comment(line)
        if m := re.fullmatch(r"#SBATCH --gpus-per-node=(\d+)", code):
            code = "#SBATCH " + ctx.site.gpu_request(m[1])
        elif per_gpu and re.fullmatch(r"#SBATCH --cpus-per-task=\d+", code):
            code, comment = f"#SBATCH --cpus-per-gpu={cores}", "# site.toml: cores per GPU"
        elif per_gpu and re.fullmatch(r"#SBATCH --mem=\S+", code):
            code, comment = f"#SBATCH --mem-per-gpu={memory}", "# site.toml: memory per GPU"
        elif cores and re.fullmatch(r"#SBATCH --cpus-per-task=\d+", code):
            code = f"#SBATCH --cpus-per-task={max(1, cores * gpus // tasks)}"
            comment = f"# site.toml: {cores} cores per GPU"
        elif memory and re.fullmatch(r"#SBATCH --mem=\S+", code):
            number, unit = int(memory[:-1]), memory[-1]
            code = f"#SBATCH --mem={number * gpus}{unit}"
            comment = f"# site.toml: {memory} per GPU"
        else:
            out.append(line)
            continue
        out.append(with_comment(code, comment, column))
    return out


def generate_text(site, name, text):
    """The centre's version of one file (name: its path under examples/)."""
    if scheduler_of(name) not in (None, site.scheduler) or not re.search(
        OPENING.pattern, text, re.M
    ):
        return text
    ctx = Context(site, text)
    lines = text.split("\n")
    out, i, outside = [], 0, []
    while i < len(lines):
        line = lines[i]
        if OPENING.match(line):
            out.extend(header_lines(ctx, outside))
            outside = []
            end = next((j for j in range(i + 1, len(lines)) if CLOSING.match(lines[j])), None)
            if end is None:
                raise GenerateError(
                    f"{name}:{i + 1}: a site-specific block without its closing line"
                )
            out.append(opening_marker(site))
            out.extend(fill_block(ctx, name, i + 1, lines[i + 1 : end]))
            out.append(lines[end])
            i = end + 1
            continue
        outside.append(line)
        i += 1
    out.extend(header_lines(ctx, outside))
    result = "\n".join(out)
    left = re.search(r"^##(SBATCH|PBS).*$", result, re.M)
    if left:
        raise GenerateError(f"{name}: a directive is still commented out: {left[0]}")
    return result


# The files of the conda route: an edition leaves them out where the centre does not allow conda
# (environment.conda = false), and its pages leave out the sections that show them.
CONDA_FILES = ("install/environment.yml", "install/make_conda_env.sh",
               "install/check_pytorch_conda.sbatch")  # fmt: skip


def omitted(site):
    """The files of examples/ that the centre's edition leaves out."""
    return set(CONDA_FILES) if site.get("environment.conda") is False else set()


def generate(site, output):
    """Write the edition's examples/ into output/examples; return the files that changed."""
    target = Path(output) / "examples"
    if target.exists():
        shutil.rmtree(target)
    changed = []
    left_out = omitted(site)
    for path in sorted(EXAMPLES.rglob("*")):
        if not path.is_file() or "__pycache__" in path.parts:
            continue
        name = path.relative_to(EXAMPLES).as_posix()
        if name in left_out:
            continue
        dest = target / name
        dest.parent.mkdir(parents=True, exist_ok=True)
        # Bytes and mode, not shutil.copy: the tests count a copied example as one they ran.
        dest.write_bytes(path.read_bytes())
        dest.chmod(path.stat().st_mode)
        if path.suffix in (".sbatch", ".qsub", ".pbs", ".sh"):
            text = path.read_text(encoding="utf-8")
            new = generate_text(site, name, text)
            if new != text:
                dest.write_text(new, encoding="utf-8")
                changed.append(name)
    return changed


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        sys.exit("usage: python3 edition/generate.py path/to/site.toml OUTPUT_DIR")
    try:
        site = load(argv[0])
        changed = generate(site, argv[1])
    except (SiteFileError, GenerateError) as error:
        sys.exit(f"generate.py: error: {error}")
    out = Path(argv[1]) / "examples"
    print(f"{site.name}: {len(changed)} scripts filled in from {site.path}, in {out}/")
    print(f"See what changed with: diff -ru examples {out}")


if __name__ == "__main__":
    main()
