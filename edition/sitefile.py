"""The site file (site.toml): what differs between HPC centres, read and checked.

One file holds a centre's choices: its name, its scheduler, partitions, account, how a job asks
for GPUs, modules, where the environment lives, scratch and data folders, the PyTorch build its
drivers need. edition/template.toml is the commented template; SCHEMA below is the reference
that the template, the "For HPC centres" page and the checks all follow.

A bad file stops whoever reads it (the edition's build, site-check) with one line naming the key:
unknown keys are never ignored, required keys must be there, values must have their type and
form. Standard library only (Python 3.11 or newer), so that site-check runs on a login node.
"""

import re
import sys
from dataclasses import dataclass
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10 or older, e.g. a login node's system python
    sys.exit("site file: reading it needs Python 3.11 or newer (e.g. module load python/3.11)")

# How a job asks for n GPUs (per node), with {n} where the count goes.
GPU_FORMS = {
    "slurm": [
        (re.compile(r"--gpus-per-node=(?:[\w.-]+:)?\{n\}"), "--gpus-per-node={n}"),
        (re.compile(r"--gres=gpu(?::[\w.-]+)?:\{n\}"), "--gres=gpu:{n} or --gres=gpu:a100:{n}"),
    ],
    "gridengine": [
        (re.compile(r"-l [\w.]+=\{n\}"), "-l gpu={n}"),
    ],
    # PBS: a resource of each chunk (-l select=N:ncpus=C:ngpus=G), without the colon.
    "pbs": [
        (re.compile(r"[A-Za-z_]\w*=\{n\}"), "ngpus={n}"),
    ],
}
NAME = re.compile(r"[\w.@/+-]+")  # partitions, accounts, modules, variables, environments
CENTRE_NAME = re.compile(r"[\w.,&'()/+:-]+(?: [\w.,&'()/+:-]+)*")
# Not in any value: line breaks (a new line in a job script is a new directive or command) and
# other control characters.
CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]")
SIZE = re.compile(r"\d+[KMGT]")
# Directives a site adds to its jobs, without the #SBATCH or #$ in front: one option with at most
# one argument, nothing a shell or the scheduler's own comment syntax would read.
DIRECTIVES = {
    "slurm": (re.compile(r"--[a-z][a-z-]*(?:=[\w.,:@%&|/+-]+)?"),
              "long options such as --constraint=gpu or --qos=normal"),
    "gridengine": (re.compile(r"-[A-Za-z]+(?: [\w.,:=@%/+-]+)?"),
                   "options such as -l rt_F=1 or -g mygroup"),
    "pbs": (re.compile(r"-[A-Za-z](?: [\w.,:=@%/+-]+)?"),
            "options such as -l place=excl or -W group_list=mygroup"),
}  # fmt: skip


@dataclass(frozen=True)
class Key:
    kind: type  # str, int, list (of str), bool
    required: bool
    help: str
    form: re.Pattern | None = None  # a str (or each str of a list) must match it
    form_help: str = ""


SCHEMA = {
    "centre": {
        "name": Key(
            str,
            True,
            "the centre's name, shown in the stamps: Verified at <name>",
            CENTRE_NAME,
            "a name of letters, digits, spaces and . , & ' ( ) / + : -",
        ),
        "documentation": Key(
            str,
            True,
            "the centre's own documentation (https://...)",
            re.compile(r"https?://[\w.~:/?#@%+=&,-]+"),
            "an http(s) address (letters, digits and . ~ : / ? # @ % + = & , - only)",
        ),
        "repository": Key(
            str,
            False,
            "the centre's copy of the guide's repository (https://...), where its pages link",
            re.compile(r"https?://[\w.~:/@%+=,-]+"),
            "an http(s) address (letters, digits and . ~ : / @ % + = , - only)",
        ),
        "login_host": Key(
            str, False, "the name users ssh to (Jupyter's tunnel)", NAME, "a host name"
        ),
    },
    "scheduler": {
        "kind": Key(
            str,
            True,
            "slurm, gridengine or pbs (PBS Professional, OpenPBS)",
            re.compile(r"slurm|gridengine|pbs"),
            "slurm, gridengine or pbs",
        ),
        "cpu_partition": Key(
            str,
            True,
            'partition (Slurm) or queue (Grid Engine, PBS) of CPU jobs; "" for the default',
            re.compile(r"[\w.@,-]*"),
            "a partition name",
        ),
        "gpu_partition": Key(
            str,
            True,
            'partition or queue of GPU jobs; "" for the default',
            re.compile(r"[\w.@,-]*"),
            "a partition name",
        ),
        "account": Key(
            str,
            False,
            "the account (Slurm) or project (Grid Engine, PBS: -P) charged",
            re.compile(r"[\w.@-]*"),
            "an account name",
        ),
        "qos": Key(
            str,
            False,
            "Slurm: the quality of service every job must name (--qos)",
            re.compile(r"[\w.-]+"),
            "a QoS name",
        ),
        "gpus": Key(str, True, "how a job asks for {n} GPUs per node"),
        "directives": Key(list, False, "directives every job adds (e.g. --qos=normal)"),
        "cpu_directives": Key(list, False, "directives every CPU job adds"),
        "gpu_directives": Key(list, False, "directives every GPU job adds (e.g. --constraint=gpu)"),
        "group": Key(
            str, False, "Grid Engine: the group every job names (-g)", NAME, "a group name"
        ),
        "cpu_resource": Key(
            str,
            False,
            "Grid Engine: the resource a CPU job asks for, in place of slots (-l rt_C.small=1)",
            re.compile(r"-l [\w.]+=\d+"),
            "-l name=number",
        ),
        "node_resource": Key(
            str,
            False,
            "Grid Engine: how a job asks for {nodes} whole nodes with all their GPUs (-l rt_F=1)",
            re.compile(r"-l [\w.]+=\{nodes\}"),
            "-l name={nodes}",
        ),
        "gpus_per_node": Key(int, False, "GPUs on a GPU node (with node_resource)"),
        "gpu_constraint": Key(
            str,
            False,
            "a feature that selects one GPU model (benchmarks)",
            re.compile(r"[\w.&|-]+"),
            "a feature name",
        ),
        "cores_per_gpu": Key(int, False, "CPU cores a GPU job gets per GPU"),
        "memory_per_gpu": Key(
            str, False, "memory a GPU job gets per GPU, e.g. 64G", SIZE, "a size such as 64G"
        ),
        "per_gpu": Key(
            bool,
            False,
            "Slurm: GPU jobs ask with --cpus-per-gpu and --mem-per-gpu (cores_per_gpu and "
            "memory_per_gpu) instead of --cpus-per-task and --mem",
        ),
        "local_disk": Key(bool, False, "jobs must ask for node-local disk (--tmp)"),
        "parallel_environment": Key(
            str,
            False,
            "Grid Engine: the shared-memory parallel environment (smp); left out where the "
            "resources name the cores",
            NAME,
            "a name",
        ),
        "queue_resources": Key(
            bool,
            False,
            "PBS: the queues set each chunk's cores, GPUs and memory (ABCI 3.0): jobs ask only "
            "for a number of chunks, -l select=N",
        ),
        "node_queue": Key(
            str,
            False,
            "PBS: the queue of whole nodes, where GPU jobs of more than one GPU or more than one "
            "chunk go (ABCI 3.0: rt_HF)",
            re.compile(r"[\w.@-]+"),
            "a queue name",
        ),
    },
    "modules": {
        "init": Key(
            list,
            False,
            "files that define `module` in batch jobs, sourced in order, where jobs lack it",
            re.compile(r"/[\w/.+-]+"),
            "absolute paths of files to source, such as /etc/profile.d/modules.sh (not commands)",
        ),
        "python": Key(
            list,
            True,
            "modules for the Python the environment was built with",
            NAME,
            "module names",
        ),
        "compiler": Key(
            list,
            False,
            "modules for a C++20 compiler and CMake (LibTorch, Horovod)",
            NAME,
            "module names",
        ),
        "cuda": Key(
            str,
            False,
            'the CUDA toolkit\'s module name, without its version; "" where there is none',
            re.compile(r"[\w.@/+-]*"),
            "a module name",
        ),
        "conda": Key(list, False, "modules that provide conda", NAME, "module names"),
        "apptainer": Key(list, False, "modules that provide apptainer", NAME, "module names"),
    },
    "environment": {
        "venv": Key(
            str,
            True,
            "where users keep the venv of make_venv.sh",
            re.compile(r"[\w$/{}.:~-]+"),
            "a path",
        ),
        "conda_env": Key(
            str,
            False,
            "where users keep the conda environment",
            re.compile(r"[\w$/{}.:~-]+"),
            "a path",
        ),
        "conda": Key(bool, False, "false where the centre does not allow conda"),
    },
    "storage": {
        "node_local": Key(
            str,
            True,
            "the variable naming a job's node-local scratch folder",
            re.compile(r"[A-Z_][A-Z0-9_]*"),
            "a variable name such as TMPDIR",
        ),
        "scratch": Key(
            str,
            True,
            "lasting scratch space for checkpoints",
            re.compile(r"[\w$/{}.:~-]+"),
            "a path",
        ),
        "project": Key(
            str,
            True,
            "project space shared by a group's jobs",
            re.compile(r"[\w$/{}.:~-]+"),
            "a path",
        ),
        "data": Key(
            str,
            False,
            "the centre's shared datasets folder",
            re.compile(r"[\w$/{}.:~-]+"),
            "a path",
        ),
    },
    "pytorch": {
        "build": Key(
            str,
            True,
            "the wheel build the centre's drivers need (#12)",
            re.compile(r"default|cu130|cu128|cu126|cpu"),
            "default, cu130, cu128, cu126 or cpu",
        ),
        "index_url": Key(
            str,
            False,
            "a mirror of PyTorch's wheel server",
            re.compile(r"https?://[\w.~:/@%+=,-]+"),
            "an http(s) address (letters, digits and . ~ : / @ % + = , - only)",
        ),
    },
}
OPTIONAL_SECTIONS = set()


class SiteFileError(Exception):
    """One line, naming the file and the key."""


@dataclass
class Site:
    path: Path
    data: dict

    def get(self, dotted, default=None):
        section, key = dotted.split(".")
        return self.data.get(section, {}).get(key, default)

    @property
    def name(self):
        return self.get("centre.name")

    @property
    def scheduler(self):
        return self.get("scheduler.kind")

    @property
    def slug(self):
        """A folder name for the edition: the file's name without .toml."""
        return re.sub(r"[^\w.-]", "-", self.path.name.removesuffix(".toml"))

    def gpu_request(self, count):
        """How a job asks for count GPUs per node: at a Grid Engine site with a whole-node
        resource, a job that asks for every GPU of a node asks for the node; at a PBS site
        whose queues set the chunks' resources, a job asks for its queue."""
        if self.scheduler == "pbs" and self.get("scheduler.queue_resources"):
            return f"-q {self.pbs_queue(count, 1)}"
        whole = self.get("scheduler.node_resource")
        if whole and str(count) == str(self.get("scheduler.gpus_per_node")):
            return whole.replace("{nodes}", "1")
        return self.get("scheduler.gpus").replace("{n}", str(count))

    def pbs_queue(self, gpus, chunks):
        """The queue of a PBS job with gpus GPUs per chunk (0: a CPU job) and chunks chunks:
        the whole-node queue (node_queue) for more than one GPU or chunk, where there is one."""
        if not gpus or str(gpus) == "0":
            return self.get("scheduler.cpu_partition")
        if self.get("scheduler.node_queue") and (str(gpus) != "1" or str(chunks) != "1"):
            return self.get("scheduler.node_queue")
        return self.get("scheduler.gpu_partition")

    def directives(self, gpu_job):
        """(key, directive) of the site's directives for every job and for a job of this kind."""
        kind = "gpu_directives" if gpu_job else "cpu_directives"
        return [(key, item) for key in ("directives", kind)
                for item in self.get(f"scheduler.{key}", [])]  # fmt: skip


def load(path):
    """The checked site file, or SiteFileError with one line naming the key."""
    path = Path(path)
    try:
        data = tomllib.loads(path.read_bytes().decode("utf-8"))
    except OSError as error:
        raise SiteFileError(f"{path}: cannot read it ({error.strerror})") from None
    except UnicodeDecodeError as error:
        raise SiteFileError(
            f"{path}: not UTF-8 text (byte 0x{error.object[error.start]:02x} at offset "
            f"{error.start}): save it as UTF-8"
        ) from None
    except tomllib.TOMLDecodeError as error:
        raise SiteFileError(f"{path}: not valid TOML: {error}") from None
    for section in data:
        if section not in SCHEMA:
            known = ", ".join(SCHEMA)
            raise SiteFileError(f"{path}: unknown section [{section}] (known: {known})")
        if not isinstance(data[section], dict):
            raise SiteFileError(f"{path}: {section} must be a section, [{section}]")
    for section, keys in SCHEMA.items():
        values = data.get(section, {})
        for key in values:
            if key not in keys:
                raise SiteFileError(
                    f"{path}: unknown key {section}.{key} (known in [{section}]: {', '.join(keys)})"
                )
        for key, spec in keys.items():
            where = f"{path}: {section}.{key}"
            if key not in values:
                if spec.required:
                    raise SiteFileError(f"{where} is missing ({spec.help})")
                continue
            check_value(where, values[key], spec)
    site = Site(path, data)
    check_gpus(site)
    return site


def check_value(where, value, spec):
    kind = {
        str: "a string",
        int: "a whole number",
        list: "a list of strings",
        bool: "true or false",
    }
    if spec.kind is int and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise SiteFileError(f"{where} must be a whole number of 1 or more (got {value!r})")
    if spec.kind is list and not (
        isinstance(value, list) and all(isinstance(item, str) for item in value)
    ):
        raise SiteFileError(f"{where} must be {kind[list]} (got {value!r})")
    if spec.kind in (str, bool) and not isinstance(value, spec.kind):
        raise SiteFileError(f"{where} must be {kind[spec.kind]} (got {value!r})")
    texts = value if isinstance(value, list) else [value] if isinstance(value, str) else []
    for item in texts:
        if isinstance(value, list) and not item.strip():
            raise SiteFileError(f"{where} has an empty item")
        if bad := CONTROL.search(item):
            raise SiteFileError(
                f"{where} must be one line without control characters "
                f"(found {bad[0]!r} in {item!r})"
            )
    if spec.form is not None:
        for item in texts:
            if not spec.form.fullmatch(item):
                raise SiteFileError(f"{where} must be {spec.form_help} (got {item!r})")


# Keys that only some schedulers read: any other refuses them.
ONLY_FOR = {
    "qos": ("slurm",),
    "per_gpu": ("slurm",),
    "group": ("gridengine",),
    "cpu_resource": ("gridengine",),
    "node_resource": ("gridengine",),
    "gpus_per_node": ("gridengine",),
    "parallel_environment": ("gridengine",),
    "local_disk": ("slurm", "gridengine"),  # --tmp
    "gpu_constraint": ("slurm", "gridengine"),  # --constraint
    "queue_resources": ("pbs",),
    "node_queue": ("pbs",),
}
SCHEDULER_NAMES = {"slurm": "Slurm", "gridengine": "Grid Engine", "pbs": "PBS"}


def check_gpus(site):
    """What depends on the scheduler: the GPU form, the directives, the keys of one kind."""
    where = f"{site.path}: scheduler.gpus"
    form = site.get("scheduler.gpus")
    forms = GPU_FORMS[site.scheduler]
    if not any(pattern.fullmatch(form) for pattern, _example in forms):
        known = "; ".join(example for _pattern, example in forms)
        raise SiteFileError(
            f"{where}: {form!r} is not a known form for {site.scheduler} (known: {known})"
        )
    keys = site.data["scheduler"]
    for key, kinds in ONLY_FOR.items():
        if key in keys and site.scheduler not in kinds:
            names = " and ".join(SCHEDULER_NAMES[kind] for kind in kinds)
            raise SiteFileError(f"{site.path}: scheduler.{key} is for {names} sites only")
    pattern, help_ = DIRECTIVES[site.scheduler]
    for key in ("directives", "cpu_directives", "gpu_directives"):
        for item in keys.get(key, []):
            if not pattern.fullmatch(item):
                raise SiteFileError(
                    f"{site.path}: scheduler.{key} must be {site.scheduler} {help_}, without "
                    f"the directive's prefix (got {item!r})"
                )
    if keys.get("per_gpu") and not ("cores_per_gpu" in keys and "memory_per_gpu" in keys):
        raise SiteFileError(
            f"{site.path}: scheduler.per_gpu needs scheduler.cores_per_gpu and "
            "scheduler.memory_per_gpu"
        )
    if ("node_resource" in keys) != ("gpus_per_node" in keys):
        raise SiteFileError(
            f"{site.path}: scheduler.node_resource and scheduler.gpus_per_node go together"
        )
    if "cpu_resource" in keys and "parallel_environment" in keys:
        raise SiteFileError(
            f"{site.path}: scheduler.cpu_resource replaces scheduler.parallel_environment: "
            "set one of them"
        )


def main(argv=None):
    """python edition/sitefile.py SITE: check a site file; one line and exit 1 when it is bad."""
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        sys.exit("usage: python edition/sitefile.py path/to/site.toml")
    try:
        site = load(argv[0])
    except SiteFileError as error:
        sys.exit(f"site file: error: {error}")
    print(f"{site.path}: a valid site file for {site.name} ({site.scheduler})")


if __name__ == "__main__":
    main()
