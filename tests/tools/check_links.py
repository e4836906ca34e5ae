"""Check every internal link of a built site: the file exists and so does the #anchor.

    python tests/tools/check_links.py _build/html

External links (http, https, mailto) are not followed: the test machines cannot reach them.
"""

import sys
from functools import cache
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urlsplit


class _Links(HTMLParser):
    def __init__(self):
        super().__init__()
        self.links, self.ids = [], set()

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if attrs.get("id"):
            self.ids.add(attrs["id"])
        for name in ("href", "src"):
            if attrs.get(name) and not (
                tag == "link"
                and attrs.get("rel") == "alternate"
                and attrs[name].startswith(("http:", "https:"))
            ):
                self.links.append(attrs[name])


@cache
def parse(path):
    parser = _Links()
    parser.feed(path.read_text(encoding="utf-8", errors="replace"))
    return parser


def broken_links(site):
    site = Path(site).resolve()
    for page in sorted(site.rglob("*.html")):
        for link in parse(page).links:
            parts = urlsplit(link)
            if parts.scheme or parts.netloc or link.startswith(("#", "javascript:")):
                if link.startswith("#") and link[1:] and unquote(link[1:]) not in parse(page).ids:
                    yield page, link
                continue
            target = (page.parent / unquote(parts.path)).resolve()
            if target.is_dir():
                target = target / "index.html"
            if not target.is_file() or not target.is_relative_to(site):
                yield page, link
            elif parts.fragment and target.suffix == ".html":
                if unquote(parts.fragment) not in parse(target).ids:
                    yield page, link


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    site = Path(argv[0] if argv else "_build/html")
    if not site.is_dir():
        print(f"check_links.py: error: {site} does not exist: build the site first (make html-all)")
        return 2
    broken = [f"{page.relative_to(site.resolve())}: {link}" for page, link in broken_links(site)]
    for line in broken:
        print(line)
    pages = sum(1 for _ in site.rglob("*.html"))
    print(f"{pages} pages, {len(broken)} broken internal links")
    return 1 if broken else 0


if __name__ == "__main__":
    sys.exit(main())
