#!/usr/bin/env python3
"""Evaluates every PromQL expression of every panel of Grafana dashboards
against a running Prometheus (GET /api/v1/query) and fails, naming the
dashboard, panel and expression, if one errors, returns no series, or returns
only NaN (a panel that would render nothing). Also checks that every panel
uses the provisioned datasource uid. Standard library only.

Used by scripts/check-dashboards.sh; by hand:

    scripts/eval-dashboards.py --prometheus http://127.0.0.1:19090 \
        [--time UNIX_TS] [--window 15s] grafana/dashboards/*.json

Grafana's interval variables ($__rate_interval, $__interval, $__range) become
--window; any other `$variable` left in an expression is an error.
"""

import argparse
import json
import math
import re
import sys
import urllib.error
import urllib.parse
import urllib.request

GRAFANA_INTERVALS = re.compile(r"\$\{?__(rate_interval|interval|range)\}?")


def panels(items):
    """Every panel, including those nested in (collapsed) rows."""
    for panel in items:
        yield panel
        yield from panels(panel.get("panels", []))


def query(prometheus, expr, at):
    params = {"query": expr}
    if at is not None:
        params["time"] = at
    url = f"{prometheus}/api/v1/query?{urllib.parse.urlencode(params)}"
    try:
        with urllib.request.urlopen(url, timeout=10) as resp:
            body = json.load(resp)
    except urllib.error.HTTPError as e:  # 400/422: a bad expression; the body says why
        body = json.load(e)
    if body.get("status") != "success":
        return None, f"{body.get('errorType', 'error')}: {body.get('error', body)}"
    return body["data"], None


def check(prometheus, at, window, datasource_uid, path):
    dashboard = json.load(open(path, encoding="utf-8"))
    name = dashboard.get("title", path)
    passed, failed = 0, []
    for panel in panels(dashboard.get("panels", [])):
        if panel.get("type") in ("row", "text"):
            continue
        where = f"{name} / {panel.get('title', panel.get('id'))}"
        targets = [t for t in panel.get("targets", []) if t.get("expr")]
        if not targets:
            failed.append(f"{where}: panel has no PromQL target")
            continue
        uids = {(panel.get("datasource") or {}).get("uid")}
        uids |= {(t.get("datasource") or {}).get("uid") for t in targets if t.get("datasource")}
        if uids != {datasource_uid}:
            failed.append(f"{where}: datasource uid {sorted(map(str, uids))} is not the provisioned {datasource_uid!r}")
        for target in targets:
            raw = target["expr"]
            expr = GRAFANA_INTERVALS.sub(window, raw)
            if "$" in expr:
                failed.append(f"{where} [{target.get('refId')}]: unknown variable in {raw}")
                continue
            data, error = query(prometheus, expr, at)
            if error:
                failed.append(f"{where} [{target.get('refId')}]: {expr}\n      -> {error}")
                continue
            kind, result = data["resultType"], data["result"]
            if kind == "scalar":
                result = [{"value": result}]
            elif kind != "vector":  # a bare range vector: Grafana's range queries reject it
                failed.append(f"{where} [{target.get('refId')}]: {expr}\n      -> a {kind}, not an instant vector")
                continue
            values = [float(r["value"][1]) for r in result]
            if not result:
                failed.append(f"{where} [{target.get('refId')}]: {expr}\n      -> no series")
            elif all(math.isnan(v) for v in values):
                failed.append(f"{where} [{target.get('refId')}]: {expr}\n      -> only NaN")
            else:
                passed += 1
                shown = ", ".join(f"{v:.4g}" for v in values[:4]) + (" …" if len(values) > 4 else "")
                print(f"  ok  {where} [{target.get('refId')}]: {len(result)} series ({shown})")
    return passed, failed


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prometheus", required=True, help="base URL, e.g. http://127.0.0.1:19090")
    ap.add_argument("--time", help="evaluation time (unix seconds; default: now)")
    ap.add_argument("--window", default="15s", help="what $__rate_interval etc. become (default 15s)")
    ap.add_argument("--datasource-uid", default="prometheus", help="the provisioned datasource uid")
    ap.add_argument("dashboards", nargs="+")
    args = ap.parse_args()

    passed, failed = 0, []
    for path in args.dashboards:
        p, f = check(args.prometheus.rstrip("/"), args.time, args.window, args.datasource_uid, path)
        passed += p
        failed += f
    for f in failed:
        print(f"FAIL {f}")
    # The plain closing line CI runners understand.
    print(f"dashboards: {passed} passed, {len(failed)} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
