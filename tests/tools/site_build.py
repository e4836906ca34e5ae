"""Build the site's languages fresh and strict, once per content: `make html-all` and the
tests (tests/test_site.py) share what it builds.

    python tests/tools/site_build.py OUT en zh_CN ja fr [-- SPHINX OPTIONS]

Each language is built with `sphinx-build -b html -E -W --keep-going` into the cache
(PYTORCH_ON_HPC_CACHE/site/<key>/<lang>/, key: a digest of everything the build reads: the
pages, the language's own folder in locale/ (a French catalog changes French's key only),
examples, records, configuration, extensions, the site file and the environment variables
conf.py reads, the options and the Sphinx and Python versions), then copied to OUT/<lang>/.
A language whose key is already in the cache is not built again: the same inputs give the same
pages and the same verdict, so a second `make test`, or the tests after `make html-all`, reuse
the build. Builds that failed are not kept. Languages are built
side by side, one process each.

Prints one line per language (built or reused, seconds) and, for a failed build, its
output; exits 1 when any language failed.
"""

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# What a build reads: the folders whole, and single files.
INPUTS = ["conf.py", "versions.toml", "requirements.txt", "source", "locale", "examples",
          "edition", "tests/records", "tests/sites"]  # fmt: skip
# The environment variables conf.py and its extensions read.
VARIABLES = ["SITE_URL", "REPOSITORY_URL", "PYTORCH_ON_HPC_SITE"]
KEEP = 24  # language builds kept in the cache, newest first: six sites of four languages


def cache_root():
    base = os.environ.get("PYTORCH_ON_HPC_CACHE") or Path(
        os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache", "pytorch-on-hpc"
    )
    return Path(base) / "site"


def _files(lang):
    for name in INPUTS:
        if name == "locale":  # a language reads its own folder there only
            name = f"locale/{lang}"
        path = ROOT / name
        if path.is_file():
            yield path
        elif path.is_dir():
            for found in sorted(path.rglob("*")):
                # Not the .mo files: the build itself compiles them from the .po catalogs.
                if found.is_file() and "__pycache__" not in found.parts and found.suffix != ".mo":
                    yield found


def key(lang, options=()):
    """The digest of everything the build of lang reads."""
    import sphinx  # noqa: PLC0415 (the venv's; only when a key is needed)

    digest = hashlib.sha256()
    for path in _files(lang):
        digest.update(str(path.relative_to(ROOT)).encode() + b"\0" + path.read_bytes() + b"\0")
    site = os.environ.get("PYTORCH_ON_HPC_SITE")
    if site and Path(site).is_file():
        digest.update(Path(site).read_bytes())
    facts = [lang, list(options), sphinx.__version__, sys.version,
             {name: os.environ.get(name) for name in VARIABLES}]  # fmt: skip
    digest.update(json.dumps(facts, sort_keys=True).encode())
    return digest.hexdigest()[:24]


def build(lang, options=()):
    """The cached build of lang: (its folder, {returncode, stdout, stderr, seconds, reused})."""
    folder = cache_root() / key(lang, options) / lang
    result = folder.parent / f"{lang}.json"
    if result.is_file() and folder.is_dir():
        found = json.loads(result.read_text(encoding="utf-8"))
        os.utime(folder.parent)  # newest first when pruning
        return folder, {**found, "reused": True}
    folder.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f".{lang}-", dir=folder.parent))
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "sphinx", "-b", "html", "-E", "-W", "--keep-going", "-j", "1",
         "-c", ROOT, "-d", scratch / "doctrees", f"-Dlanguage={lang}", *options, ROOT / "source",
         scratch / "html"],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    seconds = round(time.perf_counter() - start, 1)
    found = {"returncode": proc.returncode, "stdout": proc.stdout[-20000:],
             "stderr": proc.stderr[-20000:], "seconds": seconds}  # fmt: skip
    if proc.returncode != 0:
        shutil.rmtree(scratch, ignore_errors=True)
        return None, {**found, "reused": False}
    try:
        (scratch / "html").rename(folder)  # atomic: another run sees all of it or none
    except OSError:  # another run finished the same build first
        pass
    shutil.rmtree(scratch, ignore_errors=True)
    partial = folder.parent / f".{lang}.json.{os.getpid()}"
    partial.write_text(json.dumps(found), encoding="utf-8")
    partial.replace(result)
    return folder, {**found, "reused": False}


def build_all(langs, options=()):
    """Build the languages side by side (one process each); {lang: (folder, result)}."""
    with ThreadPoolExecutor(max_workers=len(langs)) as pool:
        done = dict(zip(langs, pool.map(lambda lang: build(lang, options), langs), strict=True))
    prune()
    return done


def prune():
    """Keep the KEEP newest language builds."""
    root = cache_root()
    if not root.is_dir():
        return
    builds = sorted((p for p in root.iterdir() if p.is_dir()), key=lambda p: p.stat().st_mtime)
    for old in builds[:-KEEP]:
        shutil.rmtree(old, ignore_errors=True)


def main(argv):
    if "--" in argv:
        at = argv.index("--")
        argv, options = argv[:at], [o for o in argv[at + 1 :] if o and o != "-E"]
    else:
        options = []
    if len(argv) < 2:
        sys.exit("usage: site_build.py OUT LANG... [-- SPHINX OPTIONS]")
    out, langs = Path(argv[0]), argv[1:]
    failed = False
    for lang, (folder, result) in build_all(langs, options).items():
        how = "reused from the cache" if result["reused"] else "built (fresh, -W)"
        print(f">>> {lang}: {how}, {result['seconds']} s")
        if folder is None:
            failed = True
            print(result["stdout"][-3000:] + result["stderr"], file=sys.stderr)
            continue
        target = out / lang
        shutil.rmtree(target, ignore_errors=True)
        shutil.copytree(folder, target)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
