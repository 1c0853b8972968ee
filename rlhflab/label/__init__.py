"""Human preference collection: generate responses, label pairs in a browser, export.

The stage the RLHF recipe puts between SFT and the reward model: several responses are
sampled for each prompt, and people compare two at a time on a five-level scale.

    rlhflab label generate   sample N responses per prompt, store candidate pairs (db.py, generate.py)
    rlhflab label import     or bring pairs from any system as jsonl (db.py)
    rlhflab label serve      the labelling page: Flask + SQLite (app.py, static/, templates/)
    rlhflab label stats      counts, pairs labelled k times, agreement (agreement.py, export.py)
    rlhflab label export     prompt/chosen/rejected/margin jsonl for `rlhflab rm` and `rlhflab dpo`

Levels, as the annotator sees them: 1 = A (left) much better, 2 = A slightly better,
3 = about the same, 4 = B (right) slightly better, 5 = B much better. The left/right
order is randomised per (pair, annotator) and recorded with each label, so the stored
canonical level (`a_level`) always speaks of the pair's own responses A and B.
See docs/labelling.md for the walk-through, the aggregation rule and the export format.
"""

LEVELS = {
    1: "A much better",
    2: "A slightly better",
    3: "About the same",
    4: "B slightly better",
    5: "B much better",
}

# The criteria the notebook seed lists for judging an explanation; shown as optional
# checkboxes ("what mattered for this choice"), changeable with `serve --criteria`.
CRITERIA = ("age-appropriateness", "engagement", "accuracy", "clarity", "interactivity")
