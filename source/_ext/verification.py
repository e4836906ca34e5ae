"""What verified each page, from the tests' records, and a download link for every script shown.

The test runs write tests/records/<suite>.json (tests/records.py): for each file in examples/,
the tests that ran it in each suite (cpu, slurm, gridengine, pbs, gpu), their outcomes and
durations, the date, the versions, and the sha256 of the file they ran. This extension reads
them at build time, so that nothing a page says about verification is typed by hand:

- under the title of every page, a stamp for the example files the page includes: CPU tests,
  the Slurm test cluster, the Grid Engine test cell, the PBS test complex, GPU ("not yet run"
  when no GPU record exists), and which files changed since their last recorded run (stale);
- under every block included from examples/, the file it comes from, a download link for the
  whole file and a link to its folder in the repository;
- the directive ``verification-table``, the table of every example of the "How this guide is
  tested" page.

Its strings are translated through the project's catalog of interface strings,
locale/<lang>/LC_MESSAGES/sphinx.po, which Sphinx compiles and reads itself.
"""

import json
import os
import re
import sys
from hashlib import sha256
from pathlib import Path

from docutils import nodes
from sphinx import addnodes
from sphinx.locale import _, get_translator
from sphinx.transforms import SphinxTransform
from sphinx.util.docutils import SphinxDirective

sys.path.insert(0, str(Path(__file__).resolve().parent))  # site_edition, when the tests import this
import site_edition  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
RECORDS = ROOT / "tests" / "records"
SUITES = ("cpu", "slurm", "gridengine", "pbs", "gpu")
TESTING_PAGE = "/about/testing"
# Files that are scripts (the tests run them); data and configuration files are shown too,
# but their stamp is that of the scripts that read them.
SCRIPT = re.compile(r".*\.(py|sh|sbatch|qsub|pbs|cpp)$|CMakeLists\.txt$")


def load_records(folder=RECORDS):
    """{suite: {example: entry}} with entry["stale"] set when the file changed since."""
    records = {}
    for suite in SUITES:
        path = Path(folder) / f"{suite}.json"
        examples = json.loads(path.read_text(encoding="utf-8"))["examples"] if path.exists() else {}
        for name, entry in examples.items():
            file = EXAMPLES / name
            current = sha256(file.read_bytes()).hexdigest() if file.is_file() else None
            entry["stale"] = current != entry["sha256"]
        records[suite] = examples
    return records


def fill(template, **parts):
    """A list of nodes: the translated template with each {name} replaced by its node."""
    result = []
    for piece in re.split(r"(\{\w+\})", template):
        name = piece[1:-1] if piece.startswith("{") and piece.endswith("}") else None
        if name in parts:
            part = parts[name]
            result.append(part if isinstance(part, nodes.Node) else nodes.Text(str(part)))
        elif piece:
            result.append(nodes.Text(piece))
    return result


def ngettext(singular, plural, count):
    """The form of a message for count, from the catalog that _() reads (sphinx.po)."""
    return get_translator("sphinx", "general").ngettext(singular, plural, count)


def separator():
    """Between two parts of a stamp (a language may space it, or not)."""
    return nodes.Text(_(" · "))


def summary(records, examples):
    """Per suite: (passed, failed, newest entry) over the tests that ran these examples."""
    result = {}
    for suite in SUITES:
        outcomes, newest = {}, None
        for name in examples:
            entry = records[suite].get(name)
            if entry is None or entry["stale"]:
                continue
            for test, (outcome, _seconds) in entry["tests"].items():
                outcomes[test] = outcome if outcomes.get(test) != "failed" else "failed"
            if newest is None or entry["date"] > newest["date"]:
                newest = entry
        failed = sum(outcome == "failed" for outcome in outcomes.values())
        result[suite] = (len(outcomes) - failed, failed, newest)
    return result


def stamp_text(records, examples):
    """The translated parts of a stamp, as lists of nodes."""
    counts = summary(records, examples)
    parts = []
    labels = {
        "cpu": _("CPU"),
        "slurm": _("Slurm test cluster"),
        "gridengine": _("Grid Engine test cell"),
        "pbs": _("PBS test complex"),
        "gpu": _("GPU"),
    }
    for suite in SUITES:
        passed, failed, newest = counts[suite]
        if newest is None:
            if suite == "gpu":
                parts.append(fill(_("{suite}: not yet run"), suite=labels[suite]))
            continue
        if failed:
            text = fill(
                ngettext("{suite}: {failed} of {total} test failed ({date})",
                         "{suite}: {failed} of {total} tests failed ({date})", passed + failed),
                suite=labels[suite], failed=failed, total=passed + failed, date=newest["date"],
            )  # fmt: skip
        elif suite == "gpu":
            text = fill(
                ngettext(
                    "{suite}: {passed} test passed ({date}, {device}, torch {torch}, CUDA {cuda})",
                    "{suite}: {passed} tests passed ({date}, {device}, torch {torch}, CUDA {cuda})",
                    passed,
                ),
                suite=labels[suite], passed=passed, date=newest["date"], device=newest["gpu"],
                torch=newest["torch"], cuda=newest["cuda"],
            )  # fmt: skip
        else:
            text = fill(
                ngettext("{suite}: {passed} test passed ({date}, torch {torch}, Python {python})",
                         "{suite}: {passed} tests passed ({date}, torch {torch}, Python {python})",
                         passed),
                suite=labels[suite], passed=passed, date=newest["date"],
                torch=newest["torch"].split("+")[0], python=newest["python"],
            )  # fmt: skip
        parts.append(text)
    return parts


def untested(records, examples):
    """Scripts among examples with no current record in any suite."""
    return sorted(
        name for name in examples
        if SCRIPT.match(Path(name).name)
        and not any(name in records[s] and not records[s][name]["stale"] for s in SUITES)
    )  # fmt: skip


def stamp(env, examples):
    """The paragraph under a page's title."""
    records = load_records()
    if not examples:
        examples = sorted(str(p.relative_to(EXAMPLES)) for p in EXAMPLES.rglob("*") if p.is_file())
        lead = _("Scripts of this guide:")
    else:
        lead = _("Scripts on this page:")
    paragraph = nodes.paragraph(classes=["verification-stamp"])
    parts = list(stamp_text(records, examples))
    stale = untested(records, examples)
    if len(stale) > 5:
        paragraph["classes"].append("verification-stale")
        parts.append(
            fill(_("{count} scripts not tested in their current version"), count=len(stale))
        )
    elif stale:
        paragraph["classes"].append("verification-stale")
        parts.append(fill(_("not tested in their current version: {files}"),
                          files=file_list(stale)))  # fmt: skip
    if site_edition.SITE is not None:
        parts += centre_stamp(examples)
    body = nodes.inline()
    for i, part in enumerate(parts):
        if i:
            body += separator()
        body.extend(part)
    link = addnodes.pending_xref(
        "", nodes.inline(), refdomain="std", reftype="doc", reftarget=TESTING_PAGE,
        refexplicit=False, refwarn=True, refdoc=env.docname,
    )  # fmt: skip
    # The lead, the parts, and the link to the testing page, spaced and bracketed as the
    # language writes them.
    paragraph.extend(fill(_("{lead} {stamp} ({link})"), lead=nodes.strong(text=lead), stamp=body,
                          link=link))  # fmt: skip
    for suite in SUITES:
        env.note_dependency(str(RECORDS / f"{suite}.json"))
    if site_edition.SITE is not None:
        env.note_dependency(str(site_edition.record_path(site_edition.SITE)))
    return paragraph


def centre_stamp(examples):
    """In a centre's edition: the stamp of its site-check record for the page's job scripts,
    as lists of nodes (none when the page shows no job script of the centre's scheduler)."""
    site = site_edition.SITE
    scripts = site_edition.job_scripts_of_the_centre(examples)
    if not scripts:
        return []
    record = site_edition.load_record()
    current = {
        name: record[name] for name in scripts if name in record and not record[name]["stale"]
    }
    if not current:
        return [fill(_("{centre}: not yet verified there (make site-check)"), centre=site.name)]
    outcomes = {name: entry["tests"]["site-check"][0] for name, entry in current.items()}
    passed = sum(outcome == "passed" for outcome in outcomes.values())
    date = max(entry["date"] for entry in current.values())
    parts = [fill(ngettext("Verified at {centre} on {date}: {passed} of {total} job script passed",
                           "Verified at {centre} on {date}: {passed} of {total} job scripts passed",
                           len(scripts)),
                  centre=site.name, date=date, passed=passed, total=len(scripts))]  # fmt: skip
    # The most GPUs one passing job ran on (its output names each: site_check.gpus_used), and
    # their model where the jobs printed it.
    passing = [current[name] for name, outcome in outcomes.items() if outcome == "passed"]
    most = max(passing, key=lambda entry: entry.get("gpus") or 0, default={})
    gpus = most.get("gpus") or 0
    if gpus:
        model = most.get("gpu_model") or next((e["gpu"] for e in passing if e.get("gpu")), "GPU")
        gpu_text = fill(_("{count} × {model}"), count=gpus, model=model)
        parts[0] += [nodes.Text(_(", "))] + gpu_text  # before the GPUs
    failed = sorted(name for name, outcome in outcomes.items() if outcome != "passed")
    if failed:
        parts.append(fill(_("failed there: {files}"), files=file_list(failed)))
    missing = sorted(set(scripts) - set(current))
    if missing:
        parts.append(fill(_("not run there in their current version: {files}"),
                          files=file_list(missing)))  # fmt: skip
    return parts


def file_list(names):
    """The file names of names, listed as the language lists them (a comma, 、, ...)."""
    files = nodes.inline()
    for i, name in enumerate(names):
        item = nodes.literal(text=Path(name).name)
        if i:
            files = nodes.inline("", "", *fill(_("{items}, {item}"), items=files, item=item))
        else:
            files += item
    return files


def centre_note():
    """In a centre's edition, under the stamp of a page with job scripts: what it chose."""
    site = site_edition.SITE
    code = nodes.literal
    paragraph = nodes.paragraph(classes=["site-edition"])
    centre = nodes.reference("", site.name, refuri=site.get("centre.documentation"))
    lead = nodes.strong("", "", *fill(_("Edition of {centre}:"), centre=centre))
    facts = [
        fill(
            _("GPU jobs go to {partition}"),
            partition=code(text=site.get("scheduler.gpu_partition") or _("the default")),
        ),
        fill(
            _("CPU jobs to {partition}"),
            partition=code(text=site.get("scheduler.cpu_partition") or _("the default")),
        ),
        fill(_("GPUs are requested with {request}"), request=code(text=gpu_requests(site))),
    ]
    if site.get("scheduler.account"):
        facts.append(
            fill(_("the account is {account}"), account=code(text=site.get("scheduler.account")))
        )
    if site.get("modules.python"):
        facts.append(fill(_("the modules are {modules}"),
                          modules=code(text=" ".join(site.get("modules.python")))))  # fmt: skip
    facts.append(fill(_("the venv is {venv}"), venv=code(text=site.get("environment.venv"))))
    if site.get("environment.conda") is False:
        facts.append([nodes.Text(_("conda is not allowed there"))])
    if site.get("storage.data"):
        facts.append(
            fill(_("shared datasets are in {data}"), data=code(text=site.get("storage.data")))
        )
    choices = nodes.inline()
    for i, fact in enumerate(facts):
        if i:
            choices += nodes.Text(_("; "))  # between two of the choices
        choices.extend(fact)
    paragraph.extend(fill(_("{lead} {choices}. {note}"), lead=lead, choices=choices, note=_(
        "The site-specific blocks of its job scripts on this page are filled in with these "
        "choices, and its stamp covers them; the project's stamp covers the generic scripts "
        "they are made from, and the scripts of the other schedulers, which stay generic."
    )))  # fmt: skip
    return paragraph


def gpu_requests(site):
    """How the centre's jobs ask for N GPUs; at a PBS site whose queues set the chunks, the
    queue of one GPU and, where it differs, that of more."""
    if site.scheduler == "pbs" and site.get("scheduler.queue_resources"):
        return " / ".join(dict.fromkeys([site.gpu_request(1), site.gpu_request(2)]))
    return site.gpu_request("N")


def included_example(node):
    """The examples/ file (or, in a centre's edition, its generated version) a literal block
    was included from, or None."""
    source = node.get("source")
    if not source:
        return None
    path = Path(source).resolve()
    generic = site_edition.generic_path(path)
    return path if EXAMPLES in generic.parents and path.is_file() else None


def source_line(env, config, path, block):
    """The line under an included block: its file, a download link, its repository folder."""
    name = site_edition.generic_path(path).relative_to(EXAMPLES).as_posix()
    docdir = Path(env.doc2path(env.docname)).parent
    whole = block.astext().strip() == path.read_text(encoding="utf-8").strip()
    download = addnodes.download_reference(
        "", "", nodes.inline(text=_("download") if whole else _("download the whole file")),
        reftarget=os.path.relpath(path, docdir), refdoc=env.docname, refexplicit=True,
        refdomain="", reftype="download",
    )  # fmt: skip
    # The folder in the repository: the centre's own copy in its edition, where it has one. A
    # file that the edition fills in has no folder in the project's repository.
    base = config.repository_url
    site = site_edition.SITE
    if site is not None and path != site_edition.generic_path(path):
        base = site.get("centre.repository")
        changed = path.read_bytes() != site_edition.generic_path(path).read_bytes()
        if not base and not changed:
            base = config.repository_url
    folder = f"{base.rstrip('/')}/tree/main/examples/{path.parent.name}" if base else None
    repository = nodes.reference("", "", nodes.Text(_("the folder in the repository")),
                                 refuri=folder)  # fmt: skip
    if folder is None:
        template = _("{file}: {download}") if whole else _("An excerpt of {file}: {download}")
    else:
        template = (
            _("{file}: {download} · {repository}")
            if whole
            else _("An excerpt of {file}: {download} · {repository}")
        )
    paragraph = nodes.paragraph(classes=["example-source"])
    paragraph.extend(fill(template, file=nodes.literal(text=name), download=download,
                          repository=repository))  # fmt: skip
    return paragraph


class VerificationTransform(SphinxTransform):
    """Adds the stamp under the title and a source line under each included example."""

    # After the translations (Locale, 20), before doctree-read (DoctreeReadEvent, 880), whose
    # collectors copy the download files.
    default_priority = 870

    def apply(self):
        if self.app.builder.name == "gettext":  # nothing of this goes into the page catalogs
            return
        examples = []
        for block in list(self.document.findall(nodes.literal_block)):
            path = included_example(block)
            if path is None:
                continue
            examples.append(site_edition.generic_path(path).relative_to(EXAMPLES).as_posix())
            block.parent.insert(
                block.parent.index(block) + 1, source_line(self.env, self.config, path, block)
            )
        section = next(iter(self.document.findall(nodes.section)), None)
        if section is None or not isinstance(section[0], nodes.title):
            return
        section.insert(1, stamp(self.env, sorted(set(examples))))
        if site_edition.job_scripts_of_the_centre(examples):
            section.insert(2, centre_note())


class VerificationTable(SphinxDirective):
    """The table of every example: where it ran, how many tests, how long, when."""

    def run(self):
        records = load_records()
        names = sorted(
            str(p.relative_to(EXAMPLES)) for p in EXAMPLES.rglob("*")
            if p.is_file() and "__pycache__" not in p.parts
        )  # fmt: skip
        headings = [_("Example"), _("CPU"), _("Slurm"), _("Grid Engine"), _("PBS"), _("GPU"),
                    _("Time (s)"), _("Date")]  # fmt: skip
        table = nodes.table(classes=["verification-table"])
        group = nodes.tgroup(cols=len(headings))
        table += group
        for width in (30, 9, 9, 9, 9, 9, 10, 14):
            group += nodes.colspec(colwidth=width)
        group += nodes.thead("", row(headings))
        body = nodes.tbody()
        for name in names:
            cells, seconds, dates = [nodes.literal(text=name)], 0.0, []
            for suite in SUITES:
                entry = records[suite].get(name)
                if entry is None:
                    cells.append("–")
                    continue
                outcomes = [outcome for outcome, _s in entry["tests"].values()]
                seconds += sum(s for _o, s in entry["tests"].values())
                dates.append(entry["date"])
                cell = fill(
                    _("{passed} passed") if "failed" not in outcomes else _("{failed} failed"),
                    passed=outcomes.count("passed"), failed=outcomes.count("failed"),
                )  # fmt: skip
                if entry["stale"]:  # no italics: CJK fonts have none
                    cell.append(nodes.inline(text=_(" (stale)"), classes=["verification-stale"]))
                cells.append(cell)
            cells += [f"{seconds:.1f}" if dates else "–", max(dates) if dates else "–"]
            body += row(cells)
        group += body
        env = self.env
        for suite in SUITES:
            env.note_dependency(str(RECORDS / f"{suite}.json"))
        return [table]


def row(cells):
    result = nodes.row()
    for cell in cells:
        entry = nodes.entry()
        paragraph = nodes.paragraph()
        if isinstance(cell, list):
            paragraph.extend(cell)
        elif isinstance(cell, nodes.Node):
            paragraph += cell
        else:
            paragraph += nodes.Text(str(cell))
        entry += paragraph
        result += entry
    return result


def setup(app):
    app.add_config_value("repository_url", "", "env")
    app.add_transform(VerificationTransform)
    app.add_directive("verification-table", VerificationTable)
    return {"version": "1.0", "parallel_read_safe": True, "parallel_write_safe": True}
