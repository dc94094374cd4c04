"""What the experiments' verdicts share: reading chaos's summary
(`effectively.chaos.v1`), `recon --json` and loadgen's report
(`loadgen.report.v1`), and writing the checks, summary.json and CSV tables.

Standard library only: the verdicts run on a fresh machine's python3.
"""
import csv
import json


def load_json(path, default=None):
    """The JSON in PATH, or DEFAULT when the file is missing or not JSON (a
    run that died before writing it)."""
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return default


def read_text(path, default=None):
    """The text of PATH, or DEFAULT when it cannot be read."""
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except OSError:
        return default


def number(v):
    """V as a float (a CSV cell, a JSON value), or None when it is empty or not a number."""
    try:
        return float(v)
    except (TypeError, ValueError):
        return None


def write_json(path, value):
    """VALUE as indented JSON in PATH, with a final newline."""
    with open(path, "w", encoding="utf-8") as f:
        json.dump(value, f, indent=2)
        f.write("\n")


def write_csv(path, rows):
    """ROWS (dicts) as a CSV table in PATH; the columns are every key, in the
    order first seen. Nothing is written for no rows."""
    if not rows:
        return
    with open(path, "w", encoding="utf-8", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(dict.fromkeys(k for r in rows for k in r)))
        w.writeheader()
        w.writerows(rows)


def read_csv(path):
    """The rows of the CSV table in PATH as dicts of strings."""
    with open(path, encoding="utf-8", newline="") as f:
        return list(csv.DictReader(f))


# --- recon --json: {"report": {...}, "intents": {...} | null, "clean", "drained", ...}

def recon_report(recon):
    """The counts of a `recon --json` output (or {} for none)."""
    return (recon or {}).get("report") or {}


def recon_intents(recon):
    """The client-intents check of a `recon --json` output (or {})."""
    return (recon or {}).get("intents") or {}


def orders_account_for_keys(orders, load, intents):
    """Whether ORDERS (recon's distinct orders) is what the client's keys
    allow: one order for each key loadgen report LOAD saw succeed, 0 or 1 for
    each ambiguous key (no answer, or a 408/5xx: it may have committed), none
    for a refused one. With recon's count of the ambiguous keys that
    committed (client-intents check INTENTS) the count is exact, else a
    range. Returns (holds, what was expected, as text)."""
    keys = (load or {}).get("keys") or {}
    succeeded, ambiguous = keys.get("succeeded") or 0, keys.get("ambiguous") or 0
    committed = (intents or {}).get("ambiguous_committed")
    if committed is not None:
        return (orders is not None and orders == succeeded + committed,
                f"keys that succeeded {succeeded} + ambiguous committed {committed}")
    return (orders is not None and succeeded <= orders <= succeeded + ambiguous,
            f"between keys that succeeded {succeeded} and that + ambiguous {ambiguous}")


# --- chaos's summary: {"recon": <recon --json>, "recon_exit", "load": <loadgen report>,
#     "services": {name: {"deaths", "counters", "recovery_ms", "lives"}}, "totals", ...}

def chaos_report(c):
    """Recon's counts in chaos summary C."""
    return recon_report(c.get("recon"))


def chaos_intents(c):
    """Recon's client-intents check in chaos summary C."""
    return recon_intents(c.get("recon"))


def deaths(c):
    """Deaths by cause (e.g. `crash_point:publish`), summed over the services
    of chaos summary C."""
    out = {}
    for s in (c.get("services") or {}).values():
        for k, v in (s.get("deaths") or {}).items():
            out[k] = out.get(k, 0) + v
    return out


def service_deaths(c, service, cause):
    """How often SERVICE died of CAUSE in chaos summary C."""
    return ((c.get("services") or {}).get(service) or {}).get("deaths", {}).get(cause, 0)


def recon_word(exit_code):
    """Recon's exit status as its word: 0 CLEAN, 1 DRIFT, else ERROR."""
    return ["CLEAN", "DRIFT"][exit_code] if exit_code in (0, 1) else "ERROR"


# --- checks and the verdict

def verdict(checks):
    """PASS when every check holds (and there is at least one), else FAIL."""
    return "PASS" if checks and all(checks.values()) else "FAIL"


def print_checks(checks, out=None):
    """One `[ok]` or `[FAILED]` line per check."""
    for k, v in checks.items():
        print(f"  [{'ok' if v else 'FAILED'}] {k}", file=out)


def exit_code(summary):
    """The process exit status for a summary: 0 on PASS."""
    return 0 if summary["verdict"] == "PASS" else 1
