"""A centre's edition of the site: its own job scripts, its choices, its verification stamps.

With a site file (make html SITE=site.toml, which sets PYTORCH_ON_HPC_SITE), this extension

- checks the site file (edition/sitefile.py) and stops the build with one line naming a bad key;
- generates the centre's examples/ (edition/generate.py) into _build/editions/<name>/examples/
  and makes every ``literalinclude`` of an examples/ file read the generated one, so that every
  job script shown and downloaded is the centre's;
- under the title of each page that shows job scripts of the centre's scheduler, says what the
  centre chose (partition, account, GPU request, modules, environment), and adds its
  site-check record's stamp to the project's ("Verified at <centre> on <date>: ...",
  verification.py);
- rewrites the pages' console blocks as the centre's users type them (EditionConsole: modules,
  venv, the interactive GPU session), and empties the sections that show files the edition
  leaves out (EditionLeavesOut: conda's, where the centre does not allow conda).

Without a site file, nothing changes: the generic guide builds as before.
"""

import json
import os
import re
import sys
from hashlib import sha256
from pathlib import Path

from docutils import nodes
from sphinx import addnodes
from sphinx.directives.code import LiteralInclude
from sphinx.errors import ConfigError
from sphinx.locale import _
from sphinx.transforms import SphinxTransform

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
EDITIONS = ROOT / "_build" / "editions"
sys.path.insert(0, str(ROOT / "edition"))

from generate import GenerateError, generate, omitted, pbs_chunk, scheduler_of  # noqa: E402
from sitefile import SiteFileError, load  # noqa: E402

SITE = None  # the loaded site file, or None for the generic guide
EDITION = None  # the generated examples/ folder


def record_path(site):
    return site.path.with_name(site.path.name.removesuffix(".toml") + ".record.json")


def setup_edition(app, config):
    global SITE, EDITION
    if not config.site_file:
        return
    try:
        SITE = load(config.site_file)
        folder = EDITIONS / SITE.slug
        generate(SITE, folder)
    except (SiteFileError, GenerateError) as error:
        raise ConfigError(str(error)) from None
    EDITION = folder / "examples"


def edition_path(path):
    """The centre's version of an examples/ file, or the path itself."""
    path = Path(path).resolve()
    if EDITION is not None and EXAMPLES in path.parents:
        return EDITION / path.relative_to(EXAMPLES)
    return path


def generic_path(path):
    """The examples/ file that a file of the edition was generated from, or the path itself."""
    path = Path(path).resolve()
    if EDITION is not None and EDITION in path.parents:
        return EXAMPLES / path.relative_to(EDITION)
    return path


class left_out(nodes.Element):  # noqa: N801 (a docutils node class)
    """Where a page includes a file that the centre's edition leaves out (its conda files where
    conda is not allowed): EditionLeavesOut empties the section around it."""


def is_left_out(path):
    path = Path(path).resolve()
    if SITE is None or EXAMPLES not in path.parents:
        return False
    return path.relative_to(EXAMPLES).as_posix() in omitted(SITE)


class EditionLiteralInclude(LiteralInclude):
    """literalinclude that reads the centre's version of a file of examples/."""

    def run(self):
        if EDITION is not None:
            _rel, full = self.env.relfn2path(self.arguments[0])
            if is_left_out(full):
                return [left_out()]
            docdir = Path(self.env.doc2path(self.env.docname)).parent
            for option in ("diff",):
                if option in self.options:
                    _rel, full = self.env.relfn2path(self.options[option])
                    self.options[option] = os.path.relpath(edition_path(full), docdir)
            _rel, full = self.env.relfn2path(self.arguments[0])
            self.arguments[0] = os.path.relpath(edition_path(full), docdir)
        return super().run()


class EditionDownloads(SphinxTransform):
    """{download} links to files of examples/ give the centre's version."""

    default_priority = 860  # before the collector that copies the files (doctree-read, 880)

    def apply(self):
        if EDITION is None:
            return
        docdir = Path(self.env.doc2path(self.env.docname)).parent
        for node in self.document.findall(addnodes.download_reference):
            _rel, full = self.env.relfn2path(node["reftarget"], self.env.docname)
            node["reftarget"] = os.path.relpath(edition_path(full), docdir)


class EditionLeavesOut(SphinxTransform):
    """A section that shows a file the edition leaves out (conda's, where conda is not allowed)
    keeps its title and says that the centre does not allow it."""

    default_priority = 200

    def apply(self):
        sections = []
        for node in list(self.document.findall(left_out)):
            section = next((p for p in _ancestors(node) if isinstance(p, nodes.section)), None)
            if section is None:
                raise ConfigError(f"{self.env.docname}: a file the edition leaves out is shown "
                                  "outside a section")  # fmt: skip
            if not any(section is seen for seen in sections):
                sections.append(section)
        for section in sections:  # its title stays, over one line that says why it is empty
            title = section.next_node(nodes.title)
            section.children = [title] if title is not None else []
            section += nodes.paragraph("", _("{centre} does not allow this: see the other ways "
                                             "on this page.").format(centre=SITE.name))  # fmt: skip


def _ancestors(node):
    while node.parent is not None:
        node = node.parent
        yield node


def console_line(site, command):
    """A command of a console block as the centre's users type it; None drops the line."""
    if re.fullmatch(r"module load python/\S+", command):
        modules = site.get("modules.python")
        return f"module load {' '.join(modules)}" if modules else None
    if command == "source ~/venvs/pytorch/bin/activate":
        return f"source {site.get('environment.venv')}/bin/activate"
    if site.scheduler == "slurm" and command.startswith("salloc "):
        gpus = re.search(r" --gpus-per-node=(\d+)", command)
        if gpus:  # an interactive GPU session: the site's request, account, partition, rules
            command = command.replace(gpus[0], " " + site.gpu_request(gpus[1]))
            extra = [f"--{option}={value}" for option, key in (("account", "account"),
                     ("qos", "qos"), ("partition", "gpu_partition"))
                     if (value := site.get(f"scheduler.{key}"))]  # fmt: skip
            extra += [directive for _key, directive in site.directives(gpu_job=True)]
            command = " ".join([command, *extra])
        return command
    if site.scheduler == "gridengine" and command.startswith("qrsh "):
        gpus = re.search(r" -l gpu=(\d+)", command)
        pe = re.search(r" -pe smp (\d+)", command)
        if gpus:
            command = command.replace(gpus[0], " " + site.gpu_request(gpus[1]))
        if pe:
            name = site.get("scheduler.parallel_environment")
            command = command.replace(pe[0], f" -pe {name} {pe[1]}" if name else "")
        extra = [f"{option} {value}" for option, key in (("-q", "gpu_partition" if gpus else
                 "cpu_partition"), ("-P", "account"), ("-g", "group"))
                 if (value := site.get(f"scheduler.{key}"))]  # fmt: skip
        extra += [directive for _key, directive in site.directives(gpu_job=bool(gpus))]
        return " ".join([command, *extra])
    if site.scheduler == "pbs" and command.startswith("qsub -I "):
        chunk = re.search(r" -l select=(\d+)((?::\w+=[\w.]+)*)(?= |$)", command)
        gpus = re.search(r":ngpus=(\d+)", chunk[2]) if chunk else None
        if chunk:  # the chunk as the site asks for it; its queue, project and directives
            command = command.replace(chunk[0], " -l " + pbs_chunk(site, chunk[1], chunk[2])[0])
        queue = site.pbs_queue(gpus[1] if gpus else 0, chunk[1] if chunk else 1)
        extra = [f"{option} {value}" for option, value in (("-P", site.get("scheduler.account")),
                 ("-q", queue)) if value]  # fmt: skip
        extra += [directive for _key, directive in site.directives(gpu_job=bool(gpus))]
        return " ".join([command, *extra])
    return command


class EditionConsole(SphinxTransform):
    """Console blocks of the pages (not included files) as the centre's users type them: its
    modules, its venv, its interactive GPU session (salloc, qrsh, qsub -I)."""

    default_priority = 210

    def apply(self):
        if SITE is None:
            return
        for block in self.document.findall(nodes.literal_block):
            if block.get("language") != "console" or block.get("source"):
                continue
            lines = []
            for line in block.astext().split("\n"):
                prompt = re.match(r"^((?:\(\S+\) )?\[[^\]]*\]\$ |\$ )(.*)$", line)
                if prompt is None:
                    lines.append(line)
                    continue
                command = console_line(SITE, prompt[2])
                if command is not None:
                    lines.append(prompt[1] + command)
            text = "\n".join(lines)
            if text != block.astext():
                block.rawsource = text
                block.children = [nodes.Text(text)]


def job_scripts_of_the_centre(examples):
    if SITE is None:
        return []
    return [name for name in examples if scheduler_of(name) == SITE.scheduler]


def load_record():
    """The centre's site-check record, {job script: entry}, with entry["stale"] set when the
    centre's version of the script changed since it ran; {} when there is none."""
    path = record_path(SITE)
    if not path.is_file():
        return {}
    examples = json.loads(path.read_text(encoding="utf-8"))["examples"]
    for name, entry in examples.items():
        current = EDITION / name
        digest = sha256(current.read_bytes()).hexdigest() if current.is_file() else None
        entry["stale"] = digest != entry.get("edition_sha256")
    return examples


def setup(app):
    app.add_config_value("site_file", os.environ.get("PYTORCH_ON_HPC_SITE", ""), "env")
    app.connect("config-inited", setup_edition, priority=400)
    app.add_directive("literalinclude", EditionLiteralInclude, override=True)
    app.add_transform(EditionDownloads)
    app.add_transform(EditionLeavesOut)
    app.add_transform(EditionConsole)
    return {"version": "1.0", "parallel_read_safe": True, "parallel_write_safe": True}
