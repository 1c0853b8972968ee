"""From labels to a preference file, and the numbers `rlhflab label stats` prints.

Export rows (jsonl), read by `rlhflab rm` and `rlhflab dpo` as they are:

    {"prompt": str, "chosen": str, "rejected": str, "margin": float,
     "pair_id": int | str, "n_labels": int}

margin is 1.0 for "much better" and 0.5 for "slightly better"; several labels of one
pair are aggregated by `agreement.aggregate` (mean signed margin). Ties (margin 0.0)
are left out unless asked for, and then carry "tie": true with chosen = A, rejected = B.
"""

from __future__ import annotations

import json
import os
import sqlite3
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

from rlhflab.label import agreement
from rlhflab.label.db import count, labelled_pairs, snapshot


@dataclass
class ExportResult:
    """What an export wrote and what it left out."""

    rows: int
    ties_written: int
    ties_dropped: int
    below_min_labels: int
    unlabelled: int

    def summary(self, out: Path) -> str:
        return (f"wrote {self.rows} rows to {out} ({self.ties_written} ties kept, "
                f"{self.ties_dropped} ties dropped, {self.below_min_labels} pairs with too few "
                f"labels, {self.unlabelled} pairs unlabelled)")


def export_rows(conn: sqlite3.Connection, keep_ties: bool = False,
                min_labels: int = 1) -> tuple[list[dict], ExportResult]:
    """Preference rows for every pair with at least `min_labels` labels (one snapshot: the
    counts describe the rows, whatever is written meanwhile)."""
    with snapshot(conn):
        pairs = labelled_pairs(conn)
        n_pairs = count(conn, "pairs")
    rows, ties_written, ties_dropped, few = [], 0, 0, 0
    for p in pairs:
        if len(p.a_levels) < min_labels:
            few += 1
            continue
        pref = agreement.aggregate(p.a_levels)
        if pref.winner is None and not keep_ties:
            ties_dropped += 1
            continue
        a_wins = pref.winner in ("A", None)
        row = {
            "prompt": p.prompt,
            "chosen": p.response_a if a_wins else p.response_b,
            "rejected": p.response_b if a_wins else p.response_a,
            "margin": pref.margin,
            "pair_id": p.pair_id,
            "n_labels": pref.n_labels,
        }
        if pref.winner is None:
            row["tie"] = True
            ties_written += 1
        rows.append(row)
    result = ExportResult(len(rows), ties_written, ties_dropped, few, n_pairs - len(pairs))
    return rows, result


def write_jsonl(rows: list[dict], out: str | Path) -> Path:
    """Write rows atomically (a temporary file renamed into place)."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    with tmp.open("w", encoding="utf-8") as fh:
        for row in rows:
            fh.write(json.dumps(row, ensure_ascii=False) + "\n")
        fh.flush()
        os.fsync(fh.fileno())
    tmp.replace(out)
    return out


def stats(conn: sqlite3.Connection) -> dict:
    """Counts per annotator, pairs labelled k times, and agreement on both scales, all read
    in one snapshot: `labels` is the sum of the annotators' labels, and of the
    pairs_labelled_k_times, even while others label."""
    with snapshot(conn):
        return _stats(conn)


def _new_annotator() -> dict:
    return {"labels": 0, "skips": 0, "median_seconds": None, "levels": {}}


def _stats(conn: sqlite3.Connection) -> dict:
    per_annotator: dict[str, dict] = {}
    for row in conn.execute(
            "SELECT annotator, COUNT(*) AS n FROM labels GROUP BY annotator"):
        per_annotator.setdefault(row["annotator"], _new_annotator())["labels"] = row["n"]
    for row in conn.execute("SELECT annotator, COUNT(*) AS n FROM skips GROUP BY annotator"):
        per_annotator.setdefault(row["annotator"], _new_annotator())["skips"] = row["n"]
    for row in conn.execute("SELECT annotator, a_level, COUNT(*) AS n FROM labels "
                            "GROUP BY annotator, a_level"):
        per_annotator.setdefault(row["annotator"], _new_annotator())["levels"][str(row["a_level"])] = row["n"]
    for who, info in per_annotator.items():
        ms = sorted(r[0] for r in conn.execute(
            "SELECT elapsed_ms FROM labels WHERE annotator=? AND elapsed_ms IS NOT NULL", (who,)))
        if ms:
            info["median_seconds"] = round(ms[len(ms) // 2] / 1000.0, 1)

    pairs = labelled_pairs(conn, include_unlabelled=True)
    times_labelled = Counter(len(p.a_levels) for p in pairs)
    five = {p.pair_id: dict(zip(p.annotators, p.a_levels, strict=True)) for p in pairs if len(p.a_levels) >= 2}
    three = {k: {a: agreement.direction(v) for a, v in by.items()} for k, by in five.items()}

    def scale(ratings: dict) -> dict:
        items = [list(by.values()) for by in ratings.values()]
        pairwise = agreement.pairwise_cohen(ratings)
        kappas = [pk.kappa for pk in pairwise if pk.kappa is not None]
        return {
            "items": len(items),
            "raw_agreement": agreement.observed_agreement(items),
            "fleiss_kappa": agreement.fleiss_kappa(items),
            "mean_cohen_kappa": sum(kappas) / len(kappas) if kappas else None,
            "cohen_pairs": [asdict(pk) for pk in pairwise],
        }

    return {
        "prompts": count(conn, "prompts"),
        "responses": count(conn, "responses"),
        "pairs": count(conn, "pairs"),
        "labels": count(conn, "labels"),
        "skips": count(conn, "skips"),
        "annotators": dict(sorted(per_annotator.items())),
        "pairs_labelled_k_times": {str(k): times_labelled[k] for k in sorted(times_labelled)},
        "agreement": {"five_level": scale(five), "direction": scale(three)},
    }


def _fmt(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.3f}"


def format_stats(s: dict) -> str:
    """The stats as a plain-text report."""
    lines = [f"{s['pairs']} pairs ({s['prompts']} prompts, {s['responses']} responses); "
             f"{s['labels']} labels, {s['skips']} skips", "",
             "pairs labelled k times:"]
    lines += [f"  k={k:<3} {n}" for k, n in s["pairs_labelled_k_times"].items()]
    lines += ["", f"{'annotator':<24} {'labels':>7} {'skips':>6} {'median s':>9}  levels 1..5 (A much .. B much)"]
    for who, info in s["annotators"].items():
        levels = " ".join(str(info["levels"].get(str(k), 0)) for k in range(1, 6))
        med = "-" if info["median_seconds"] is None else f"{info['median_seconds']:.1f}"
        lines.append(f"{who[:24]:<24} {info['labels']:>7} {info['skips']:>6} {med:>9}  {levels}")
    if not s["annotators"]:
        lines.append("  (no labels yet)")
    lines.append("")
    for name, title in (("five_level", "five levels"), ("direction", "direction (A / same / B)")):
        a = s["agreement"][name]
        lines.append(f"agreement, {title}: {a['items']} pairs with 2+ labels; raw "
                     f"{_fmt(a['raw_agreement'])}, Fleiss' kappa {_fmt(a['fleiss_kappa'])}, "
                     f"mean Cohen's kappa {_fmt(a['mean_cohen_kappa'])}")
    pairs = s["agreement"]["direction"]["cohen_pairs"]
    if pairs:
        lines.append("Cohen's kappa (direction) per two annotators:")
        for pk in pairs:
            lines.append(f"  {pk['annotator_1']} / {pk['annotator_2']}: {pk['shared']} shared, "
                         f"agreement {pk['agreement']:.3f}, kappa {_fmt(pk['kappa'])}")
    if s["agreement"]["five_level"]["items"] == 0:
        lines.append("(agreement needs pairs labelled by 2+ people: serve with --labels-per-pair 2 or more)")
    return "\n".join(lines)
