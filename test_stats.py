"""stats.py: a request's statistics."""
from stats import Stats


def test_stats_report_the_mean_accepted_length():
    st = Stats(new_tokens=10, prefill_s=0.5, decode_s=1.5, target_forwards=4, accept_hist={1: 2, 4: 2}, extra=dict(x=1))
    d = st.as_dict()
    assert d["mean_accepted_length"] == 2.5 and d["tokens_per_s"] == 5.0 and d["decode_tokens_per_s"] == 6.67
    assert d["accept_hist"] == {"1": 2, "4": 2} and d["x"] == 1 and "phase_s" not in d
