"""Whole-index analyses: the batched strategy sweep (`sweep`), strategy evaluation and
selection (`strategy_eval`), two metrics compared query by query (`compare`: per-query AP),
and the HTML report (`report`)."""
