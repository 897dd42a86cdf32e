#!/usr/bin/env python3
"""Fails on a link that leads nowhere: in the built book (every .html file
under BOOK_DIR, which mdBook made from docs/book) and in the markdown files
named after it (the README). A relative link must name a file that exists
and, with `#anchor`, an id in that file; links to other hosts are not
followed (the tests reach no internet host).

Usage: check-links.py BOOK_DIR [FILE.md ...]
"""

import re
import sys
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urlsplit


class Page(HTMLParser):
    """The ids a page defines and the links it makes."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.ids = set()
        self.links = []

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        for name in ("id", "name"):
            if attrs.get(name):
                self.ids.add(attrs[name])
        for name in ("href", "src"):
            if attrs.get(name) and not (tag == "link" and attrs.get("rel") in ("preconnect", "dns-prefetch")):
                self.links.append(attrs[name])


def external(link):
    parts = urlsplit(link)
    return bool(parts.scheme or parts.netloc)


def github_slug(heading):
    """The anchor GitHub gives a markdown heading."""
    text = re.sub(r"[`*_]|\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def markdown_ids(path):
    ids, in_code = set(), False
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            in_code = not in_code
        elif not in_code and re.match(r"#{1,6} ", line):
            ids.add(github_slug(line.lstrip("#")))
        ids.update(re.findall(r'<a (?:id|name)="([^"]+)"', line))
    return ids


def check_book(book):
    pages, broken = {}, []
    for path in sorted(book.rglob("*.html")):
        page = Page()
        text = path.read_text(errors="replace")
        page.feed(text)
        pages[path.resolve()] = page
        # mdBook leaves an include whose file is gone as it was, and says so only in its log.
        for unexpanded in sorted(set(re.findall(r"\{\{#[^}]*\}\}", text))):
            broken.append(f"{path.relative_to(book)}: {unexpanded}: not expanded (a missing file?)")
    for path, page in pages.items():
        for link in page.links:
            if external(link) or link.startswith(("javascript:", "data:")):
                continue
            target, _, anchor = link.partition("#")
            # mdBook's 404 page links from the site's root (its site-url, "/" by default).
            base = book.resolve() if target.startswith("/") else path.parent
            file = (base / unquote(target.lstrip("/"))).resolve() if target else path
            if file.is_dir():
                file = file / "index.html"
            if not file.exists():
                broken.append(f"{path.relative_to(book.resolve())}: {link}: no such file")
            elif anchor and file.suffix == ".html" and unquote(anchor) not in pages[file].ids:
                broken.append(f"{path.relative_to(book.resolve())}: {link}: no such anchor")
    return len(pages), broken


def check_markdown(path):
    broken, text = [], re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    links = re.findall(r"\]\(([^)\s]+)\)", text) + re.findall(r'<img [^>]*src="([^"]+)"', text)
    for link in links:
        if external(link):
            continue
        target, _, anchor = link.partition("#")
        file = (path.parent / unquote(target)).resolve() if target else path
        if not file.exists():
            broken.append(f"{path}: {link}: no such file")
        elif anchor and file.suffix == ".md" and anchor not in markdown_ids(file):
            broken.append(f"{path}: {link}: no such anchor")
    return broken


def main():
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    book = Path(sys.argv[1])
    count, broken = check_book(book)
    if count == 0:
        broken.append(f"{book}: no HTML pages (was the book built?)")
    for name in sys.argv[2:]:
        broken += check_markdown(Path(name))
    for line in broken:
        print(f"broken link: {line}", file=sys.stderr)
    if broken:
        sys.exit(f"{len(broken)} broken link(s)")
    print(f"links checked: {count} pages of the book, {len(sys.argv) - 2} markdown file(s), none broken")


if __name__ == "__main__":
    main()
