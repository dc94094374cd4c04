#!/usr/bin/env python3
"""Validates docker-compose.yml without Docker: against the Compose
Specification JSON schema, then a few checks the schema cannot make.
Needs jsonschema and PyYAML (the project's venv, `scripts/tools.sh venv`).

    .tools/venv/bin/python scripts/validate-compose.py SCHEMA.json docker-compose.yml

Checks beyond the schema: every image has a pinned tag (not `latest`); every
depends_on names a service; every published port binds 127.0.0.1; every
bind-mounted file or folder (but what the `secrets` service makes in
./.compose/) and the build context's Dockerfile exist; no environment
value holds a password (in a URL or a *PASSWORD variable): secrets are files.
`${VAR:-default}` is interpolated with the default (or the environment) first,
as `docker compose config` would.
"""

import json
import os
import re
import sys

import jsonschema
import yaml

# `$$` is a literal `$` (e.g. in a shell command); `${VAR}`, `${VAR:-default}`, `${VAR-default}`.
# scheme://user:password@host
PASSWORD_IN_URL = re.compile(r"\w+://[^/@:\s]+:[^/@\s]+@")
INTERPOLATION = re.compile(r"\$\$|\$\{(\w+)(?::?-([^}]*))?\}")


def interpolate(node):
    if isinstance(node, dict):
        return {k: interpolate(v) for k, v in node.items()}
    if isinstance(node, list):
        return [interpolate(v) for v in node]
    if isinstance(node, str):
        return INTERPOLATION.sub(
            lambda m: "$" if m.group(0) == "$$" else os.environ.get(m.group(1), m.group(2) or ""), node)
    return node


def semantic_errors(compose, base):
    errors = []
    services = compose.get("services", {})
    for name, svc in services.items():
        image = svc.get("image")
        if image and "build" not in svc:
            tag = image.rsplit("/", 1)[-1].partition(":")[2]
            if not tag or tag == "latest":
                errors.append(f"{name}: image {image!r} has no pinned tag")
        deps = svc.get("depends_on", {})
        for dep in deps if isinstance(deps, (list, dict)) else []:
            if dep not in services:
                errors.append(f"{name}: depends_on names no service: {dep!r}")
        for port in svc.get("ports", []):
            host_ip = port.get("host_ip") if isinstance(port, dict) else (str(port).split(":")[0] if str(port).count(":") == 2 else None)
            if host_ip != "127.0.0.1":
                errors.append(f"{name}: port {port!r} is not published on 127.0.0.1 only")
        for vol in svc.get("volumes", []):
            source = vol.get("source") if isinstance(vol, dict) else vol.split(":")[0]
            # ./.compose/ is made at run time, by the `secrets` service.
            made_at_run_time = source.startswith("./.compose/")
            if source.startswith((".", "/")) and not made_at_run_time and not os.path.exists(os.path.join(base, source)):
                errors.append(f"{name}: bind-mount source {source!r} does not exist")
        env = svc.get("environment", {})
        for key, value in (env.items() if isinstance(env, dict) else []):
            if isinstance(value, str) and PASSWORD_IN_URL.search(value):
                errors.append(f"{name}: {key} carries a password in a URL (use a password file)")
            if key.endswith("PASSWORD"):
                errors.append(f"{name}: {key} holds a password in the compose file (use {key}_FILE)")
        build = svc.get("build")
        if build is not None:
            context = build if isinstance(build, str) else build.get("context", ".")
            dockerfile = "Dockerfile" if isinstance(build, str) else build.get("dockerfile", "Dockerfile")
            if not os.path.isfile(os.path.join(base, context, dockerfile)):
                errors.append(f"{name}: build file {os.path.join(context, dockerfile)!r} does not exist")
    return errors


def main():
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    schema_path, compose_path = sys.argv[1], sys.argv[2]
    with open(schema_path, encoding="utf-8") as f:
        schema = json.load(f)
    with open(compose_path, encoding="utf-8") as f:
        compose = interpolate(yaml.safe_load(f))

    # The schema says "https://json-schema.org/draft-07/schema" (no trailing
    # `#`), which validator_for() does not recognise; pick the draft by name.
    meta = schema.get("$schema", "")
    drafts = {"draft-07": jsonschema.Draft7Validator, "draft/2019-09": jsonschema.Draft201909Validator,
              "draft/2020-12": jsonschema.Draft202012Validator}
    validator_class = next((v for k, v in drafts.items() if k in meta), jsonschema.Draft7Validator)
    validator_class.check_schema(schema)
    validator = validator_class(schema, format_checker=validator_class.FORMAT_CHECKER)
    errors = [f"schema: {'/'.join(map(str, e.absolute_path)) or '(top)'}: {e.message}"
              for e in sorted(validator.iter_errors(compose), key=lambda e: list(map(str, e.absolute_path)))]
    errors += semantic_errors(compose, os.path.dirname(os.path.abspath(compose_path)))
    for e in errors:
        print(f"{compose_path}: {e}")
    services = ", ".join(compose.get("services", {}))
    if errors:
        print(f"{compose_path}: INVALID ({len(errors)} problems)")
        return 1
    print(f"{compose_path}: valid against the Compose Specification schema ({validator_class.__name__}); services: {services}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
