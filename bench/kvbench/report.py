"""The comparison's outputs: CSV and JSON per system and rate, a markdown table, PNG plots."""

import csv
import json
import os

from .stats import cdf

CSV_FIELDS = [
    "system", "rate", "achieved_rate", "requests", "failures",
    "ttft_mean", "ttft_p50", "ttft_p90", "ttft_p99", "itl_mean", "itl_p90",
    "e2e_mean", "e2e_p90", "output_tok_s", "requests_per_s", "response_hit_rate",
    "engine_hit_rate", "load_imbalance", "requests_per_pod",
    "pod_ttft_mean", "pod_ttft_p90", "floor_mean", "floor_p90",
]


def _fmt(v, digits=3):
    if v is None:
        return "—"
    if isinstance(v, float):
        return f"{v:.{digits}f}"
    return str(v)


def write_csv(path, rows):
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_FIELDS, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow({**r, "requests_per_pod": " ".join(str(x) for x in r.get("requests_per_pod") or [])})


def write_json(path, summary):
    with open(path, "w") as f:
        json.dump(summary, f, indent=1)


def placement_table(per_system):
    """Where each system put the prefixes (kvpick-sim's request log, whole run)."""
    lines = []
    for s in per_system:
        p = s.get("placement") or {}
        if "copies_per_prefix" not in p:
            continue
        lines.append(
            f"| {s['system']} | {p['prefixes']} | {_fmt(p['copies_per_prefix'], 2)} | {p['prefix_moves']} "
            f"| {p['repeat_misses']}/{p['repeat_requests']} "
            f"| {p.get('behind_prefill', '—')} ({p.get('behind_prefill_avoidable', '—')}) "
            f"| {p.get('piled', '—')} |"
        )
    if not lines:
        return ""
    head = [
        "\nWhere the prefixes went (every request of the run, from the pods' request logs):\n",
        "| system | prefixes | pods per prefix | moves | repeat requests missing ≥ ½ "
        "| queued behind a prefill (while a pod had none) | piled onto one pod (3rd+ within 20 ms) |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    return "\n".join(head + lines) + "\n"


def ttft_split_table(rows):
    """Each stage's TTFT split in two (the pods' own, from their request logs; the rest: the
    client, the gateway and the router), beside the floor no router can go below."""
    ms = lambda v: None if v is None else v * 1000  # noqa: E731
    lines = []
    for r in rows:
        if r.get("pod_ttft_mean") is None:
            continue
        path = None if r["ttft_mean"] is None else r["ttft_mean"] - r["pod_ttft_mean"]
        lines.append(
            f"| {r['system']} | {_fmt(r['rate'], 1)} | {_fmt(ms(r['ttft_mean']), 0)} / {_fmt(ms(r['ttft_p90']), 0)} "
            f"| {_fmt(ms(r['pod_ttft_mean']), 0)} / {_fmt(ms(r['pod_ttft_p90']), 0)} | {_fmt(ms(path), 1)} "
            f"| {_fmt(ms(r.get('floor_mean')), 0)} / {_fmt(ms(r.get('floor_p90')), 0)} |"
        )
    if not lines:
        return ""
    head = [
        "\nWhere the time to first token went (ms; the pods' own from their request logs; the floor is "
        "the least any router could reach: every block seen before still cached, an idle pod):\n",
        "| system | rate (req/s) | TTFT mean / p90 | at the pods mean / p90 | the rest (client, gateway, router), mean "
        "| floor mean / p90 |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    return "\n".join(head + lines) + "\n"


def cpu_table(per_system):
    """CPU seconds each system's processes used while the load ran, and per request."""
    lines = []
    for s in per_system:
        cpu = s.get("cpu_seconds_under_load") or {}
        done = sum(s.get("requests_per_pod") or [])
        if not cpu:
            continue
        parts = ", ".join(
            f"{name} {sec:.1f} s" + (f" ({1000 * sec / done:.2f} ms/request)" if done else "")
            for name, sec in sorted(cpu.items(), key=lambda kv: -kv[1])
        )
        lines.append(f"- {s['system']}: {parts}")
    if not lines:
        return ""
    return "\nCPU while the load ran (utime+stime of each process's session):\n\n" + "\n".join(lines) + "\n"


def markdown_table(rows, time_scale):
    """Rows per system and rate; times in ms of wall clock (divide by the time scale for
    the A100-cost equivalent)."""
    out = [
        f"| system | rate (req/s) | ok/total | TTFT mean ms | TTFT p90 ms | TTFT p99 ms | ITL mean ms "
        f"| e2e p90 s | output tok/s | hit rate (responses) | hit rate (engines) | requests per pod |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    ms = lambda v: None if v is None else v * 1000  # noqa: E731
    for r in rows:
        ok = r["requests"] - r["failures"]
        out.append(
            f"| {r['system']} | {_fmt(r['rate'], 1)} | {ok}/{r['requests']} | {_fmt(ms(r['ttft_mean']), 0)} "
            f"| {_fmt(ms(r['ttft_p90']), 0)} | {_fmt(ms(r['ttft_p99']), 0)} | {_fmt(ms(r['itl_mean']), 1)} "
            f"| {_fmt(r['e2e_p90'], 2)} | {_fmt(r['output_tok_s'], 0)} | {_fmt(r['response_hit_rate'], 2)} "
            f"| {_fmt(r['engine_hit_rate'], 2)} | {' '.join(str(x) for x in r.get('requests_per_pod') or [])} |"
        )
    return "\n".join(out) + "\n"


def plots(out_dir, rows, title):
    """ttft_cdf.png (per system, at the highest rate), ttft_p90_vs_rate.png,
    output_tps_vs_rate.png. Returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    systems = list(dict.fromkeys(r["system"] for r in rows))
    top = max(r["rate"] for r in rows)
    paths = []

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for s in systems:
        for r in rows:
            if r["system"] == s and r["rate"] == top and r["ttft_per_request"]:
                xs, ys = cdf(r["ttft_per_request"])
                ax.step([x * 1000 for x in xs], ys, where="post", label=s)
    ax.set_xscale("log")
    ax.set_xlabel("time to first token (ms, log)")
    ax.set_ylabel("fraction of requests")
    ax.set_title(f"TTFT CDF at {top:g} req/s — {title}", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    p = os.path.join(out_dir, "ttft_cdf.png")
    fig.tight_layout()
    fig.savefig(p, dpi=120)
    plt.close(fig)
    paths.append(p)

    for key, ylabel, name, scale, log in [
        ("ttft_p90", "TTFT p90 (ms, log)", "ttft_p90_vs_rate.png", 1000, True),
        ("output_tok_s", "output tokens/s", "output_tps_vs_rate.png", 1, False),
    ]:
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for s in systems:
            pts = sorted((r["rate"], r[key]) for r in rows if r["system"] == s and r[key] is not None)
            if pts:
                ax.plot([x for x, _ in pts], [y * scale for _, y in pts], marker="o", label=s)
        if log:
            ax.set_yscale("log")
        ax.set_xlabel("offered rate (req/s, Poisson)")
        ax.set_ylabel(ylabel)
        ax.set_title(title, fontsize=9)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
        p = os.path.join(out_dir, name)
        fig.tight_layout()
        fig.savefig(p, dpi=120)
        plt.close(fig)
        paths.append(p)
    return paths
