#!/usr/bin/env bash
# pack-raw.sh DIR FILE...: packs a results folder's bulky raw files (FILE...,
# paths relative to DIR) into DIR/raw.tar.gz and removes them, so that a run
# keeps its summary, plots and tables as plain files and the rest in one
# archive (`tar xzf raw.tar.gz` in DIR brings them back). The same files give
# the same archive, byte for byte. A FILE that is not there is skipped (an
# unmatched glob); with none left it does nothing. It will not replace an
# existing raw.tar.gz.
set -euo pipefail
[ $# -ge 1 ] || { echo "usage: $0 DIR FILE..." >&2; exit 2; }
cd "$1"
shift
[ ! -e raw.tar.gz ] || { echo "pack-raw: $PWD/raw.tar.gz exists already" >&2; exit 1; }
files=()
for f in "$@"; do
  f=${f#./}
  if [ -f "$f" ]; then files+=("$f"); fi
done
[ ${#files[@]} -gt 0 ] || exit 0
printf '%s\0' "${files[@]}" | LC_ALL=C sort -z | tar -czf raw.tar.gz.part --sort=name --mtime='2026-11-25 00:00Z' \
  --owner=0 --group=0 --numeric-owner --mode=u=rw,go=r --null --verbatim-files-from -T -
mv raw.tar.gz.part raw.tar.gz
rm -f -- "${files[@]}"
