#!/usr/bin/env bash
# make check-config: validates the compose stack's configuration without Docker.
#
#   1. docker-compose.yml against the Compose Specification JSON schema (taken
#      from a pinned npm package by scripts/tools.sh, never committed), with
#      jsonschema + PyYAML from the project venv (.tools/venv), plus the checks
#      of scripts/validate-compose.py (pinned images, 127.0.0.1 ports, ...);
#   2. prometheus/prometheus.yml (compose) and prometheus/check.yml
#      (make check-dashboards) with `promtool check config`, and the alerting
#      rules (prometheus/alerts.yml) with their unit tests (`promtool test
#      rules prometheus/alerts_test.yml`);
#   3. the Grafana provisioning YAML parses and the dashboards are valid JSON.
#
# Installs what is missing on first use (venv, Debian's prometheus package for
# promtool, the schema). Run: scripts/check-config.sh
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"

PY=$(scripts/tools.sh venv)
SCHEMA=$(scripts/tools.sh compose-schema)
scripts/tools.sh prometheus

echo "-- docker-compose.yml"
"$PY" scripts/validate-compose.py "$SCHEMA" docker-compose.yml

echo "-- promtool check config"
promtool check config prometheus/prometheus.yml
promtool check config prometheus/check.yml

echo "-- promtool test rules (the alerting rules)"
promtool test rules prometheus/alerts_test.yml

echo "-- grafana provisioning and dashboards"
"$PY" - grafana/provisioning/*/*.yml grafana/dashboards/*.json <<'PY'
import json, sys, yaml
for path in sys.argv[1:]:
    with open(path, encoding="utf-8") as f:
        doc = json.load(f) if path.endswith(".json") else yaml.safe_load(f)
    assert isinstance(doc, dict), f"{path}: not a mapping"
    if path.endswith(".json"):
        assert doc.get("uid") and doc.get("panels"), f"{path}: a dashboard needs a uid and panels"
    print(f"  {path}: ok")
PY
echo "check-config: ok"
