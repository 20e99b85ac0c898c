"""Per launch and model: hook, 1-bit (Horovod) and 1-bit@gloo median step, ratios to the hook
of the same launch, and @gloo's commit / waits (ms, median rank's means)."""

import json
import re
import statistics
import sys
from pathlib import Path

runs = Path(sys.argv[1])
log = (runs / "pairs.log").read_text().splitlines()
loads = {}
for line in log:
    m = re.match(r"\S+ start (\w+) load: .*load average: ([\d.]+)", line)
    if m:
        loads[m.group(1)] = m.group(2)
rows_out = []
ratios: dict = {}
names = sorted(
    (
        p.name
        for p in runs.iterdir()
        if p.is_dir() and p.name[1:].isdigit() and (p / "cluster.json").exists()
    ),
    key=lambda n: (int(n[1:]), n[0]),
)
print(
    "| run | code | model | load at start | floor s | hook s | onebit s | onebit@gloo s | onebit / hook | @gloo / hook | best / hook | onebit settle+commit ms | @gloo settle+commit ms | @gloo waits dense/scatter/gather ms |"  # noqa: E501
)
print("|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
for name in names:
    rows = json.loads((runs / name / "cluster.json").read_text())
    for model in ("mlp8m", "cnn"):
        by = {(r["system"], r["scheme"]): r for r in rows if r["model"] == model}
        hook = next(r for (s, _), r in by.items() if s == "ddp")
        one, glo = (
            by[("hvd-compress", "onebit")],
            by[("hvd-compress", "onebit@gloo")] if ("hvd-compress", "onebit@gloo") in by else None,
        )
        glo = glo or next(
            r
            for r in rows
            if r["model"] == model
            and r["system"] == "hvd-compress"
            and r["settings"].get("collectives") == "gloo"
        )
        one = next(
            r
            for r in rows
            if r["model"] == model
            and r["system"] == "hvd-compress"
            and r["settings"].get("collectives") == "horovod"
        )
        h = hook["step_s"]
        a, b = one["step_s"] / h, glo["step_s"] / h
        e = glo["exchange_s"]
        code = (
            "before (877234c)"
            if name[0] == "A"
            else ("after (593fd9c)" if name == "B1" else "after (bc9f3ce)")
        )
        print(
            f"| {name} | {code} | {model} | {loads.get(name, '?')} | {glo['floor_s']:.3f} | {h:.3f} | "  # noqa: E501
            f"{one['step_s']:.3f} | {glo['step_s']:.3f} | {a:.2f} | {b:.2f} | {min(a, b):.2f} | "
            f"{1000 * one['exchange_s'].get('settle', 0):.0f}+{1000 * one['exchange_s'].get('commit', 0):.0f} | "  # noqa: E501
            f"{1000 * e.get('settle', 0):.0f}+{1000 * e.get('commit', 0):.0f} | "
            f"{1000 * e.get('wait dense', 0):.0f}/{1000 * e.get('wait scatter', 0):.0f}/"
            f"{1000 * e.get('wait gather', 0):.0f} |"
        )
        ratios.setdefault((name[0], model), []).append((a, b, min(a, b)))
print()
for (side, model), rs in sorted(ratios.items()):
    print(
        f"- {side} {model}: onebit/hook {[round(r[0], 2) for r in rs]} median "
        f"{statistics.median(r[0] for r in rs):.2f}; @gloo/hook {[round(r[1], 2) for r in rs]} "
        f"median {statistics.median(r[1] for r in rs):.2f}; best/hook median "
        f"{statistics.median(r[2] for r in rs):.2f}"
    )

print()
print(
    "| run | model | route | settle ms | commit ms (after the last round) | feedback ms | scheme ms | CPU ms/step |"  # noqa: E501
)
print("|---|---|---|---:|---:|---:|---:|---:|")
for name in names:
    for r in json.loads((runs / name / "cluster.json").read_text()):
        if r["system"] != "hvd-compress":
            continue
        e = r["exchange_s"]
        route = "@gloo" if r["settings"].get("collectives") == "gloo" else "Horovod"
        print(
            f"| {name} | {r['model']} | {route} | {1000 * e.get('settle', 0):.1f} | "
            f"{1000 * e.get('commit', 0):.1f} | {1000 * e.get('feedback', 0):.1f} | "
            f"{1000 * e.get('scheme', 0):.1f} | {1000 * r['cpu_s_per_step']:.0f} |"
        )
commits: dict = {}
for name in names:
    for r in json.loads((runs / name / "cluster.json").read_text()):
        if r["system"] == "hvd-compress" and name != "B1":  # B1: 593fd9c, no split yet
            e = r["exchange_s"]
            commits.setdefault((name[0], r["model"]), []).append(
                (1000 * e.get("commit", 0), 1000 * (e.get("commit", 0) + e.get("settle", 0)))
            )
print()
for (side, model), cs in sorted(commits.items()):
    print(
        f"- {side} {model}: commit after the last round, ms (both routes) "
        f"{[round(c[0]) for c in cs]} median {statistics.median(c[0] for c in cs):.1f}; "
        f"settle+commit {[round(c[1]) for c in cs]} median "
        f"{statistics.median(c[1] for c in cs):.1f}"
    )
