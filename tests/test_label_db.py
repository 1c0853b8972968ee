"""The labelling database: import, serving order, idempotent submissions, export, stats."""

import json

import pytest
from label_helpers import make_db

from rlhflab.errors import UserError
from rlhflab.label import db as labeldb
from rlhflab.label.db import LabelIn, Rejected
from rlhflab.label.export import export_rows, format_stats, stats, write_jsonl


@pytest.fixture
def conn(tmp_path):
    c = labeldb.connect(make_db(tmp_path / "p.db", n_prompts=3, responses_per_prompt=3))
    yield c
    c.close()


def _label(conn, sub, who, pair_id, level, **kw):
    return labeldb.submit_label(conn, LabelIn(sub, who, pair_id, level, **kw))


def _pair_texts(conn, pair_id):
    row = conn.execute("SELECT ra.text, rb.text FROM pairs p JOIN responses ra ON ra.id = p.response_a "
                       "JOIN responses rb ON rb.id = p.response_b WHERE p.id = ?", (pair_id,)).fetchone()
    return row[0], row[1]


def test_database_is_wal_and_durable(conn):
    assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert conn.execute("PRAGMA synchronous").fetchone()[0] == 2  # FULL


def test_every_pair_of_distinct_responses_is_stored(conn):
    # 3 prompts x C(3, 2) = 9 pairs, 9 responses
    assert labeldb.count(conn, "pairs") == 9
    assert labeldb.count(conn, "responses") == 9


def test_import_jsonl_both_row_shapes_and_reimport_adds_nothing(tmp_path):
    src = tmp_path / "in.jsonl"
    src.write_text("\n".join(json.dumps(r) for r in [
        {"prompt": "p1", "response_a": "a", "response_b": "b", "id": "x-1"},
        {"prompt": "p1", "response_a": "b", "response_b": "a"},        # same pair, other order
        {"prompt": "p2", "responses": ["u", "v", "w", "u"]},           # 3 distinct -> 3 pairs
        {"prompt": "p3", "response_a": "same", "response_b": "same"},  # identical: skipped
        {"prompt": "p4", "response_a": "c", "response_b": "d", "id": 7},
    ]) + "\n\n")
    conn = labeldb.connect(tmp_path / "x.db", create=True)
    first = labeldb.import_jsonl(conn, src)
    assert (first.rows, first.pairs_added, first.pairs_existing, first.identical_skipped) == (5, 5, 1, 2)
    again = labeldb.import_jsonl(conn, src)
    assert (again.pairs_added, again.pairs_existing) == (0, 6)
    assert labeldb.count(conn, "pairs") == 5
    ids = {p.pair_id for p in labeldb.labelled_pairs(conn, include_unlabelled=True)}
    assert "x-1" in ids and 7 in ids  # imported ids keep their JSON type


@pytest.mark.parametrize("line, fragment", [
    ("{not json", "not valid JSON"),
    ('{"response_a": "a", "response_b": "b"}', "'prompt'"),
    ('{"prompt": "p", "response_a": "a"}', "'response_a' and 'response_b'"),
    ('{"prompt": "p", "responses": ["only one"]}', "at least 2 strings"),
    ('{"prompt": "p", "response_a": "a", "response_b": "b", "id": [1]}', "'id'"),
    ('["a list"]', "expected a JSON object"),
])
def test_import_bad_rows_name_the_line_and_add_nothing(tmp_path, line, fragment):
    src = tmp_path / "bad.jsonl"
    src.write_text('{"prompt": "ok", "response_a": "a", "response_b": "b"}\n' + line + "\n")
    conn = labeldb.connect(tmp_path / "x.db", create=True)
    with pytest.raises(UserError) as err:
        labeldb.import_jsonl(conn, src)
    assert "bad.jsonl line 2: " in str(err.value) and fragment in str(err.value)
    assert labeldb.count(conn, "pairs") == 0  # all or nothing


def test_import_reused_id_for_other_responses_is_refused(tmp_path):
    src = tmp_path / "in.jsonl"
    src.write_text('{"prompt": "p", "response_a": "a", "response_b": "b", "id": 1}\n'
                   '{"prompt": "p", "response_a": "c", "response_b": "d", "id": 1}\n')
    with pytest.raises(UserError, match="already names a different pair"):
        labeldb.import_jsonl(labeldb.connect(tmp_path / "x.db", create=True), src)


def test_connect_refuses_missing_and_foreign_files(tmp_path):
    with pytest.raises(UserError, match="no such file"):
        labeldb.connect(tmp_path / "missing.db")
    (tmp_path / "junk.db").write_text("not sqlite at all" * 100)
    with pytest.raises(UserError, match="not an SQLite database"):
        labeldb.connect(tmp_path / "junk.db")


def test_flip_is_stable_and_roughly_balanced(conn):
    flips = [labeldb.is_flipped(conn, pid, f"ann{k}") for pid in range(1, 10) for k in range(40)]
    assert 0.35 < sum(flips) / len(flips) < 0.65
    assert labeldb.is_flipped(conn, 3, "ann") == labeldb.is_flipped(conn, 3, "ann")


def test_next_pair_shows_the_recorded_order(conn):
    pair = labeldb.next_pair(conn, "ann")
    a, b = _pair_texts(conn, pair["pair_id"])
    assert pair["flipped"] == labeldb.is_flipped(conn, pair["pair_id"], "ann")
    assert (pair["left"], pair["right"]) == ((b, a) if pair["flipped"] else (a, b))
    assert labeldb.next_pair(conn, "ann") == pair  # a reload shows the same pair


def test_label_is_stored_in_pair_terms_whatever_the_side(conn):
    # Clicking level 1 (left much better) means "A much better" unless the left showed B.
    for pid in range(1, 10):
        flipped = labeldb.is_flipped(conn, pid, "ann")
        _label(conn, f"sub-ann-{pid:04d}", "ann", pid, 1)
        a_level = conn.execute("SELECT a_level FROM labels WHERE pair_id=?", (pid,)).fetchone()[0]
        assert a_level == (5 if flipped else 1)


def test_next_pair_skips_done_pairs_and_respects_labels_per_pair(conn):
    seen = []
    for i in range(9):
        pair = labeldb.next_pair(conn, "ann", labels_per_pair=2)
        seen.append(pair["pair_id"])
        _label(conn, f"sub-ann-{i:04d}", "ann", pair["pair_id"], 2)
    assert sorted(seen) == list(range(1, 10))
    assert labeldb.next_pair(conn, "ann", labels_per_pair=2) is None
    # bob still sees pairs with 1 label < 2; with a limit of 1 nothing is left for him
    assert labeldb.next_pair(conn, "bob", labels_per_pair=2) is not None
    assert labeldb.next_pair(conn, "bob", labels_per_pair=1) is None
    assert labeldb.next_pair(conn, "bob", labels_per_pair=None) is not None


def test_least_labelled_pairs_come_first(conn):
    _label(conn, "sub-ann-0001", "ann", 1, 1)
    for who in ["bob", "cy", "dee"]:
        assert labeldb.next_pair(conn, who, labels_per_pair=None)["pair_id"] != 1


def test_retry_with_same_submission_id_is_stored_once(conn):
    first = _label(conn, "sub-retry-01", "ann", 2, 4, comment="c", criteria=("clarity",))
    again = _label(conn, "sub-retry-01", "ann", 2, 4, comment="c", criteria=("clarity",))
    assert first.stored and not again.stored and first.id == again.id
    assert labeldb.count(conn, "labels") == 1


@pytest.mark.parametrize("args, status", [
    (("sub-retry-01", "ann", 2, 5), 409),   # same id, other content
    (("sub-other-02", "ann", 2, 4), 409),   # same annotator and pair, new id
    (("sub-other-03", "ann", 999, 4), 404),  # unknown pair
])
def test_clashing_submissions_are_rejected_and_change_nothing(conn, args, status):
    _label(conn, "sub-retry-01", "ann", 2, 4)
    before = conn.execute("SELECT * FROM labels").fetchall()
    with pytest.raises(Rejected) as err:
        _label(conn, *args)
    assert err.value.status == status
    assert [tuple(r) for r in conn.execute("SELECT * FROM labels")] == [tuple(r) for r in before]


def test_wrong_flipped_claim_is_rejected(conn):
    flipped = labeldb.is_flipped(conn, 1, "ann")
    with pytest.raises(Rejected, match="flipped"):
        _label(conn, "sub-flip-001", "ann", 1, 1, flipped=not flipped)
    assert _label(conn, "sub-flip-001", "ann", 1, 1, flipped=flipped).stored


def test_skip_hides_the_pair_and_is_idempotent(conn):
    pair = labeldb.next_pair(conn, "ann")
    s1 = labeldb.submit_skip(conn, "skip-0000001", "ann", pair["pair_id"])
    s2 = labeldb.submit_skip(conn, "skip-0000001", "ann", pair["pair_id"])
    assert s1.stored and not s2.stored
    assert labeldb.next_pair(conn, "ann")["pair_id"] != pair["pair_id"]
    with pytest.raises(Rejected) as err:
        labeldb.submit_skip(conn, "skip-0000002", "ann", 999)
    assert err.value.status == 404
    assert labeldb.progress(conn, "ann")["my_skips"] == 1


def _label_a(conn, who, pid, a_level, n):
    """Label pair `pid` so that its stored a_level is `a_level`, whatever the shown order."""
    level = 6 - a_level if labeldb.is_flipped(conn, pid, who) else a_level
    _label(conn, f"sub-{who}-{pid:04d}-{n}", who, pid, level)


def test_export_aggregates_and_handles_ties(conn, tmp_path):
    _label_a(conn, "ann", 1, 1, 0)                                    # A much: A, 1.0
    _label_a(conn, "ann", 2, 4, 0)                                    # B slightly: B, 0.5
    _label_a(conn, "ann", 3, 1, 0)                                    # +2 -1: A, 0.25
    _label_a(conn, "bob", 3, 4, 0)
    _label_a(conn, "ann", 4, 1, 0)                                    # +2 -2: tie
    _label_a(conn, "bob", 4, 5, 0)
    _label_a(conn, "ann", 5, 3, 0)                                    # about the same: tie
    rows, result = export_rows(conn)
    by = {r["pair_id"]: r for r in rows}
    assert sorted(by) == [1, 2, 3]
    a1, b1 = _pair_texts(conn, 1)
    assert by[1] == {"prompt": by[1]["prompt"], "chosen": a1, "rejected": b1, "margin": 1.0,
                     "pair_id": 1, "n_labels": 1}
    assert list(by[1]) == ["prompt", "chosen", "rejected", "margin", "pair_id", "n_labels"]
    a2, b2 = _pair_texts(conn, 2)
    assert (by[2]["chosen"], by[2]["rejected"], by[2]["margin"]) == (b2, a2, 0.5)
    assert (by[3]["margin"], by[3]["n_labels"]) == (0.25, 2)
    assert (result.rows, result.ties_dropped, result.unlabelled) == (3, 2, 4)

    rows, result = export_rows(conn, keep_ties=True)
    ties = [r for r in rows if r.get("tie")]
    assert sorted(r["pair_id"] for r in ties) == [4, 5]
    assert all(r["margin"] == 0.0 for r in ties) and result.ties_written == 2
    assert all("tie" not in r for r in rows if r["pair_id"] in (1, 2, 3))

    rows, result = export_rows(conn, min_labels=2)
    assert [r["pair_id"] for r in rows] == [3] and result.below_min_labels == 3

    out = write_jsonl(rows, tmp_path / "sub" / "prefs.jsonl")
    assert [json.loads(line) for line in out.read_text().splitlines()] == rows


def test_stats_counts_and_agreement(conn):
    # pairs 1-3 labelled by ann and bob; they agree on direction for 1 and 2, not on 3
    for pid, (x, y) in {1: (1, 2), 2: (5, 5), 3: (1, 5)}.items():
        _label_a(conn, "ann", pid, x, 0)
        _label_a(conn, "bob", pid, y, 0)
    _label_a(conn, "ann", 4, 3, 0)
    labeldb.submit_skip(conn, "skip-bob-0005", "bob", 5)
    s = stats(conn)
    assert s["annotators"]["ann"]["labels"] == 4 and s["annotators"]["bob"]["skips"] == 1
    assert s["pairs_labelled_k_times"] == {"0": 5, "1": 1, "2": 3}
    five, three = s["agreement"]["five_level"], s["agreement"]["direction"]
    assert five["items"] == 3
    assert five["raw_agreement"] == pytest.approx(1 / 3)  # only pair 2 (5, 5) agrees exactly
    assert three["raw_agreement"] == pytest.approx(2 / 3)  # A/A, B/B, A/B
    # direction, Cohen: ann = [A, B, A], bob = [A, B, B]; p_o = 2/3;
    # p_e = P(A) P(A) + P(B) P(B) = (2/3)(1/3) + (1/3)(2/3) = 4/9 -> kappa = (2/3 - 4/9) / (5/9) = 0.4
    assert three["mean_cohen_kappa"] == pytest.approx(0.4)
    # Fleiss: P_bar = 2/3; p_A = 3/6, p_B = 3/6 -> P_e = 1/2 -> kappa = (2/3 - 1/2) / (1/2) = 1/3
    assert three["fleiss_kappa"] == pytest.approx(1 / 3)
    text = format_stats(s)
    assert "Fleiss' kappa 0.333" in text and "ann / bob" in text


# ------------------------------------------------------------------ reservations (issue 52)


def test_an_offered_pair_is_held_for_its_annotator_until_it_expires(conn):
    # 9 pairs, limit 1, reservations of 60 s; times are given, so nothing depends on the clock
    t0 = 1000.0
    a = labeldb.next_pair(conn, "ann", 1, reserve_seconds=60, now=t0)["pair_id"]
    assert labeldb.next_pair(conn, "ann", 1, reserve_seconds=60, now=t0 + 30)["pair_id"] == a  # a reload
    others = [labeldb.next_pair(conn, f"w{k}", 1, reserve_seconds=60, now=t0 + 31) for k in range(8)]
    ids = [p["pair_id"] for p in others]
    assert a not in ids and sorted(ids + [a]) == list(range(1, 10))  # 8 others, 8 other pairs
    # every pair is labelled or on a screen: a ninth annotator gets nothing, and is told why
    assert labeldb.next_pair(conn, "late", 1, reserve_seconds=60, now=t0 + 32) is None
    assert labeldb.progress(conn, "late", 1, now=t0 + 32)["reserved_pairs"] == 9
    # ann's hold was renewed at t0 + 30, so it lasts to t0 + 90; w0..w7 hold to t0 + 91
    assert labeldb.next_pair(conn, "late", 1, reserve_seconds=60, now=t0 + 89) is None
    assert labeldb.next_pair(conn, "late", 1, reserve_seconds=60, now=t0 + 90.5)["pair_id"] == a
    # ann comes back after her hold ran out: her label is still stored (nothing is lost),
    # and the pair now has one label beyond the limit once "late" labels it too
    _label(conn, "sub-ann-late", "ann", a, 2)
    _label(conn, "sub-late-0001", "late", a, 4)
    assert conn.execute("SELECT COUNT(*) FROM labels WHERE pair_id=?", (a,)).fetchone()[0] == 2


def test_label_and_skip_release_the_hold(conn):
    t0 = 1000.0
    a = labeldb.next_pair(conn, "ann", 1, reserve_seconds=600, now=t0)["pair_id"]
    labeldb.submit_skip(conn, "skip-ann-0001", "ann", a)
    assert conn.execute("SELECT COUNT(*) FROM reservations").fetchone()[0] == 0
    b = labeldb.next_pair(conn, "bob", 1, reserve_seconds=600, now=t0)["pair_id"]
    _label(conn, "sub-bob-0001", "bob", b, 1)
    assert conn.execute("SELECT COUNT(*) FROM reservations").fetchone()[0] == 0
    # a held pair that others filled meanwhile (a label without a reservation) is given up
    c = labeldb.next_pair(conn, "cy", 1, reserve_seconds=600, now=t0)["pair_id"]
    _label(conn, "sub-dee-0001", "dee", c, 3)
    assert labeldb.next_pair(conn, "cy", 1, reserve_seconds=600, now=t0 + 1)["pair_id"] not in (b, c)


def test_with_limit_two_a_pair_is_offered_to_two_annotators_at_most(conn):
    # 9 pairs x 2 = 18 places: 18 annotators each hold a different place, the 19th gets none
    held = [labeldb.next_pair(conn, f"a{k:02d}", 2, reserve_seconds=600, now=1.0)["pair_id"]
            for k in range(18)]
    assert sorted(held) == sorted(list(range(1, 10)) * 2)
    assert labeldb.next_pair(conn, "a18", 2, reserve_seconds=600, now=1.0) is None


def test_no_reservations_reads_only(conn):
    a = labeldb.next_pair(conn, "ann", 1, reserve_seconds=0)["pair_id"]
    assert conn.execute("SELECT COUNT(*) FROM reservations").fetchone()[0] == 0
    assert not conn.in_transaction
    assert labeldb.next_pair(conn, "ann", 1, reserve_seconds=0)["pair_id"] == a


def test_a_database_from_before_reservations_gets_the_table(tmp_path):
    path = make_db(tmp_path / "old.db", n_prompts=1)
    c = labeldb.connect(path)
    c.execute("DROP TABLE reservations")
    c.close()
    c = labeldb.connect(path)
    assert labeldb.next_pair(c, "ann", 1)["pair_id"] == 1
    c.close()


# ------------------------------------------------------------------ snapshots and backups


def test_snapshot_sees_one_state_while_another_connection_writes(conn, tmp_path):
    other = labeldb.connect(tmp_path / "p.db")
    with labeldb.snapshot(conn):
        before = labeldb.count(conn, "labels")
        _label(other, "sub-other-001", "zed", 1, 2)  # committed by another connection
        assert labeldb.count(conn, "labels") == before == 0  # the snapshot does not move
        assert stats(conn)["labels"] == 0 and stats(conn)["annotators"] == {}
    assert labeldb.count(conn, "labels") == 1  # a new read sees the commit
    s = stats(conn)
    assert s["labels"] == sum(a["labels"] for a in s["annotators"].values()) == 1
    other.close()


def test_backup_copies_a_consistent_database(conn, tmp_path):
    _label(conn, "sub-ann-0001", "ann", 1, 2, comment="kept")
    out = labeldb.backup(conn, tmp_path / "copy" / "b.db")
    copy = labeldb.connect(out)
    assert [r["comment"] for r in copy.execute("SELECT comment FROM labels")] == ["kept"]
    assert labeldb.count(copy, "pairs") == 9 and stats(copy)["labels"] == 1
    copy.close()
    with pytest.raises(UserError, match="already exists"):
        labeldb.backup(conn, out)
