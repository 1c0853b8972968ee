"""`rlhflab label {generate,import,serve,stats,export}`: human preference collection.

    rlhflab label generate --model PATH --prompts prompts.jsonl --n 4 --out pairs.db [--backend vllm]
    rlhflab label import pairs.jsonl --db pairs.db
    rlhflab label serve --db pairs.db [--port 8765] [--token T]
    rlhflab label stats --db pairs.db [--json]
    rlhflab label export --db pairs.db --out prefs.jsonl [--keep-ties] [--min-labels K]
    rlhflab label backup --db pairs.db --out copy.db

See docs/labelling.md.
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import os
from pathlib import Path

from rlhflab.cliargs import number
from rlhflab.errors import UserError
from rlhflab.label import CRITERIA


def add_parser(parser: argparse.ArgumentParser) -> None:
    # The numbers of these subcommands are range-checked where they are used: --n by the
    # `label generate` config, --port, --labels-per-pair, --max-comment, --min-labels in run().
    sub = parser.add_subparsers(dest="action", metavar="ACTION", required=True)

    p = sub.add_parser("generate", help="sample N responses per prompt from a model, store pairs",
                       description="Sample N responses per prompt and store prompts, responses and "
                                   "every pair of distinct responses in an SQLite file.")
    p.add_argument("--model", help="local folder or hub name of a causal LM (sets model.name_or_path)")
    p.add_argument("--prompts", required=True, help='jsonl file, one {"prompt": ...} per line')
    p.add_argument("--n", type=int, help="responses per prompt, at least 2 (sets n, which the config checks; default 4)")
    p.add_argument("--out", required=True, help="SQLite file to create or add to")
    p.add_argument("--backend", choices=("hf", "vllm"),
                   help="who samples (sets generation.backend): hf, Hugging Face generate (the default), or "
                        "vllm, a vLLM engine on the model folder (size its KV cache with generation.vllm.kv_cache_gb)")
    p.add_argument("--use-chat-template", choices=("auto", "true", "false"), type=str.lower,
                   help="wrap each prompt in the tokenizer's chat template (sets use_chat_template): auto, the "
                        "default, when the tokenizer has one; false sends the file's text as it is")
    p.add_argument("--config", help="YAML with generation: (temperature, top_p, max_new_tokens...) "
                                    "and other keys of `label generate`")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                   help="dotted overrides, e.g. generation.temperature=0.7 pairs_per_prompt=3")

    p = sub.add_parser("import", help="add pairs from a jsonl file (outputs of any system)",
                       description='Rows: {"prompt", "response_a", "response_b", "id"?, "source"?} '
                                   'or {"prompt", "responses": [...]} (every pair of distinct responses).')
    p.add_argument("file", help="jsonl file of pairs")
    p.add_argument("--db", required=True, help="SQLite file to create or add to")

    p = sub.add_parser("serve", help="the labelling web page",
                       description="Serve the labelling page for one database.")
    p.add_argument("--db", required=True, help="SQLite file made by generate or import")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8765, help="port (0 picks a free one; default 8765)")
    p.add_argument("--token", default=os.environ.get("RLHFLAB_LABEL_TOKEN"),
                   help="shared access token; every request without it gets 401 "
                        "(default: $RLHFLAB_LABEL_TOKEN)")
    p.add_argument("--annotator-tokens", metavar="FILE",
                   help='JSON {"name": "token", ...}: one token per annotator, who then need not type a name')
    p.add_argument("--labels-per-pair", type=int, default=1,
                   help="stop offering a pair once it has this many labels; 2+ measures agreement "
                        "(default 1; 0 means no limit)")
    p.add_argument("--reserve-minutes", type=number(0, 7 * 24 * 60), default=10.0,
                   help="a pair offered to an annotator is held for them this long, so others are not "
                        "offered it past the limit (default 10, at most 10080, a week; 0 holds nothing)")
    p.add_argument("--criteria", default=",".join(CRITERIA),
                   help="comma-separated criteria checkboxes (default: %(default)s); '' hides them")
    p.add_argument("--max-comment", type=int, default=2000, help="longest comment in characters (default 2000)")
    p.add_argument("--insecure", action="store_true",
                   help="allow a non-loopback --host without a token")
    p.add_argument("--quiet", action="store_true", help="do not log each request")

    p = sub.add_parser("stats", help="counts per annotator, pairs labelled k times, agreement")
    p.add_argument("--db", required=True, help="SQLite file")
    p.add_argument("--json", action="store_true", help="print JSON instead of a report")

    p = sub.add_parser("export", help="write prompt/chosen/rejected/margin jsonl for rm and dpo")
    p.add_argument("--db", required=True, help="SQLite file")
    p.add_argument("--out", required=True, help="jsonl file to write")
    p.add_argument("--keep-ties", action="store_true",
                   help='keep pairs judged about the same (margin 0.0, "tie": true)')
    p.add_argument("--min-labels", type=int, default=1,
                   help="export only pairs with at least this many labels (default 1)")

    p = sub.add_parser("backup", help="copy the database safely while servers write to it",
                       description="A consistent copy of a labelling database with SQLite's online "
                                   "backup API; servers can keep running.")
    p.add_argument("--db", required=True, help="SQLite file")
    p.add_argument("--out", required=True, help="the copy to write (a new file, or one to replace)")


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _generate(args: argparse.Namespace) -> int:
    from rlhflab.config.loader import load_config
    from rlhflab.label.generate import LabelGenerateConfig, generate_pairs

    overrides = list(args.overrides)
    if args.model:
        overrides.append(f"model.name_or_path={args.model}")
    if args.n is not None:
        overrides.append(f"n={args.n}")
    if args.backend is not None:
        overrides.append(f"generation.backend={args.backend}")
    if args.use_chat_template is not None:
        overrides.append(f"use_chat_template={args.use_chat_template}")
    cfg, _ = load_config(args.config, LabelGenerateConfig, overrides)
    result = generate_pairs(cfg, args.prompts, args.out)
    print(f"{args.out}: {result.summary()}")
    return 0


def _import(args: argparse.Namespace) -> int:
    from rlhflab.label import db as labeldb

    db = Path(args.db)
    created = not db.exists()
    conn = labeldb.connect(db, create=True)
    try:
        result = labeldb.import_jsonl(conn, args.file)
    except UserError:
        conn.close()
        if created:  # a failed import into a new database leaves no empty database behind
            for path in (db, db.with_name(db.name + "-wal"), db.with_name(db.name + "-shm")):
                path.unlink(missing_ok=True)
        raise
    finally:
        conn.close()
    print(f"{args.db}: {result.summary()}")
    return 0


def _serve(args: argparse.Namespace) -> int:
    from rlhflab.label import db as labeldb
    from rlhflab.label.app import LOOPBACK_NAMES, create_app, load_annotator_tokens, serve

    if not 0 <= args.port <= 65535:
        raise UserError(f"--port {args.port}: choose 1..65535, or 0 for a free port")
    if args.labels_per_pair < 0:
        raise UserError(f"--labels-per-pair {args.labels_per_pair}: must be >= 1, or 0 for no limit")
    if args.max_comment < 0:
        raise UserError(f"--max-comment {args.max_comment}: must be >= 0")
    annotator_tokens = load_annotator_tokens(args.annotator_tokens) if args.annotator_tokens else None
    loopback = _is_loopback(args.host)
    if not loopback and not (args.token or annotator_tokens) and not args.insecure:
        raise UserError(f"--host {args.host} opens the page to the network without a token; "
                        "set --token (or --annotator-tokens), or pass --insecure")
    if args.token is not None and len(args.token) < 8:
        raise UserError("--token: use at least 8 characters (e.g. `python -c 'import secrets; "
                        "print(secrets.token_urlsafe())'`)")
    criteria = tuple(c.strip() for c in args.criteria.split(",") if c.strip())
    app = create_app(args.db, token=args.token, annotator_tokens=annotator_tokens,
                     labels_per_pair=args.labels_per_pair or None, criteria=criteria,
                     max_comment=args.max_comment, reserve_seconds=60.0 * args.reserve_minutes,
                     allowed_hosts=(LOOPBACK_NAMES | {args.host}) if loopback else None)
    conn = labeldb.connect(args.db)
    n_pairs = labeldb.count(conn, "pairs")
    conn.close()
    auth = "token required; " if (args.token or annotator_tokens) else ""
    serve(app, args.host, args.port, quiet=args.quiet, announce=f"{n_pairs} pairs in {args.db}; {auth}")
    return 0


def _stats(args: argparse.Namespace) -> int:
    from rlhflab.label import db as labeldb
    from rlhflab.label.export import format_stats, stats

    conn = labeldb.connect(args.db)
    try:
        s = stats(conn)
    finally:
        conn.close()
    print(json.dumps(s, indent=2) if args.json else format_stats(s))
    return 0


def _export(args: argparse.Namespace) -> int:
    from rlhflab.label import db as labeldb
    from rlhflab.label.export import export_rows, write_jsonl

    if args.min_labels < 1:
        raise UserError(f"--min-labels {args.min_labels}: must be >= 1")
    conn = labeldb.connect(args.db)
    try:
        rows, result = export_rows(conn, keep_ties=args.keep_ties, min_labels=args.min_labels)
    finally:
        conn.close()
    if not rows:
        raise UserError(f"--db {args.db}: no pair to export ({result.ties_dropped} ties dropped, "
                        f"{result.below_min_labels} with too few labels, {result.unlabelled} unlabelled); "
                        "label some pairs first, or pass --keep-ties")
    out = write_jsonl(rows, args.out)
    print(result.summary(Path(out)))
    return 0


def _backup(args: argparse.Namespace) -> int:
    from rlhflab.label import db as labeldb

    src = labeldb.connect(args.db)
    try:
        out = labeldb.backup(src, args.out)
    finally:
        src.close()
    print(f"{args.db} -> {out}: {out.stat().st_size} bytes, integrity ok")
    return 0


def run(args: argparse.Namespace) -> int:
    return {"generate": _generate, "import": _import, "serve": _serve,
            "stats": _stats, "export": _export, "backup": _backup}[args.action](args)
