"""Every link to an anchor within the built book (href="page.html#id" or
"#id") names an id that page has: mdbook-linkcheck2 checks that files exist,
not the headings a link points into, and a renamed heading breaks those
silently. Usage: check_anchors.py BOOK_HTML_DIR; exit 1 naming each broken one."""

import html.parser
import pathlib
import sys
import urllib.parse


class Page(html.parser.HTMLParser):
    def __init__(self):
        super().__init__()
        self.ids, self.links = set(), []

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if attrs.get("id"):
            self.ids.add(attrs["id"])
        if tag == "a" and attrs.get("href"):
            self.links.append(attrs["href"])


def main(root):
    root = pathlib.Path(root)
    pages = {}
    for path in root.rglob("*.html"):
        if "api" in path.relative_to(root).parts[:1]:
            continue  # the rustdoc, checked by rustdoc itself
        page = Page()
        page.feed(path.read_text(encoding="utf-8"))
        pages[path.resolve()] = page
    broken = []
    for path, page in pages.items():
        for href in page.links:
            url = urllib.parse.urlsplit(href)
            if url.scheme or url.netloc or not url.fragment:
                continue
            target = (path.parent / url.path).resolve() if url.path else path
            if target.suffix != ".html" or target not in pages:
                continue  # a file of the repository, checked by the link checker
            if urllib.parse.unquote(url.fragment) not in pages[target].ids:
                broken.append(f"{path.relative_to(root.resolve())}: {href}")
    for line in broken:
        print(f"broken anchor: {line}", file=sys.stderr)
    print(f"anchors: {sum(len(p.links) for p in pages.values())} links in {len(pages)} pages, {len(broken)} broken")
    return 1 if broken else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
