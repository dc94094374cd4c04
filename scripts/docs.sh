#!/usr/bin/env bash
# make docs: the book (docs/book, mdBook) built into docs/book/book/html, every
# link checked (mdbook-linkcheck2: within the book, and to the repository's own
# files; scripts/lib/check_anchors.py: each link into a heading; a broken one
# fails the build), and the library's rustdoc
# (cargo doc -p effectively, every feature) copied in beside it as api/, which
# the book's introduction links to. mdbook and mdbook-linkcheck2 are installed
# from crates.io when missing (scripts/tools.sh docs-tools, once per machine).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
log() { printf 'docs: %s\n' "$*" >&2; }
die() { log "error: $*"; exit 1; }

scripts/tools.sh docs-tools
OUT=docs/book/book
rm -rf "$OUT"
# Both backends of book.toml: html, then linkcheck2 (which fails on a link to
# a file that is not there); then each link into a heading must find it.
RUST_BACKTRACE=0 mdbook build docs/book || die "mdbook build failed (a broken link is named above)"
python3 scripts/lib/check_anchors.py "$OUT/html" || die "a link into a heading that is not there (named above)"
# The repository's own top-level documents link into the book and the tree:
# each relative link must name a file or directory that is there.
missing=0
for doc in README.md ARCHITECTURE.md FINDINGS.md; do
  while IFS= read -r target; do
    target=${target%%#*}
    [ -z "$target" ] || [ -e "$target" ] || { log "$doc links to $target, which is not there"; missing=1; }
  done < <(grep -oE '\]\([^)[:space:]]+\)' "$doc" | sed -E 's/^\]\((.*)\)$/\1/' | grep -vE '^[a-z]+:')
done
[ "$missing" = 0 ] || die "a broken link in the repository's documents (named above)"
cargo doc -q -p effectively --all-features --no-deps || die "cargo doc -p effectively failed"
DOC=${CARGO_TARGET_DIR:-$ROOT/target}/doc
[ -f "$DOC/effectively/index.html" ] || die "no rustdoc at $DOC/effectively/index.html"
cp -r "$DOC" "$OUT/html/api"
log "the book: $OUT/html/index.html ($(find docs/book/src -name '*.md' | wc -l) pages, links checked), the library's API: $OUT/html/api/effectively/index.html"
