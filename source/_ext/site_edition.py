"""A centre's edition of the site: its own job scripts, its choices, its verification stamps.

With a site file (make html SITE=site.toml, which sets PYTORCH_ON_HPC_SITE), this extension

- checks the site file (edition/sitefile.py) and stops the build with one line naming a bad key;
- generates the centre's examples/ (edition/generate.py) into _build/editions/<name>/examples/
  and makes every ``literalinclude`` of an examples/ file read the generated one, so that every
  job script shown and downloaded is the centre's;
- under the title of each page that shows job scripts of the centre's scheduler, says what the
  centre chose (partition, account, GPU request, modules, environment), and adds its
  site-check record's stamp to the project's ("Verified at <centre> on <date>: ...",
  verification.py).

Without a site file, nothing changes: the generic guide builds as before.
"""

import json
import os
import sys
from hashlib import sha256
from pathlib import Path

from docutils import nodes
from sphinx import addnodes
from sphinx.directives.code import LiteralInclude
from sphinx.errors import ConfigError
from sphinx.transforms import SphinxTransform

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
EDITIONS = ROOT / "_build" / "editions"
sys.path.insert(0, str(ROOT / "edition"))

from generate import GenerateError, generate, omitted, scheduler_of  # noqa: E402
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
    conda is not allowed): EditionLeavesOut removes the section around it."""


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
    """A section that shows a file the edition leaves out goes, title and all."""

    default_priority = 200

    def apply(self):
        for node in list(self.document.findall(left_out)):
            section = next((p for p in _ancestors(node) if isinstance(p, nodes.section)), None)
            if section is None:
                raise ConfigError(f"{self.env.docname}: a file the edition leaves out is shown "
                                  "outside a section")  # fmt: skip
            if section.parent is not None:
                section.parent.remove(section)


def _ancestors(node):
    while node.parent is not None:
        node = node.parent
        yield node


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
    return {"version": "1.0", "parallel_read_safe": True, "parallel_write_safe": True}
