"""stats.py: a request's statistics and its clock (phases and step laps)."""
import time

from stats import PHASES, Clock, Stats


def test_clock_adds_phases_and_laps_steps():
    phase_s = dict.fromkeys(PHASES, 0.0)
    clock = Clock(phase_s)
    with clock("verify"):
        time.sleep(0.01)
    with clock("verify"):
        time.sleep(0.01)
    first = clock.lap()
    second = clock.lap()
    assert 0.02 <= phase_s["verify"] <= first and phase_s["draft"] == 0.0 and 0 <= second < first


def test_stats_report_the_mean_accepted_length():
    st = Stats(new_tokens=10, prefill_s=0.5, decode_s=1.5, target_forwards=4, accept_hist={1: 2, 4: 2}, extra=dict(x=1))
    d = st.as_dict()
    assert d["mean_accepted_length"] == 2.5 and d["tokens_per_s"] == 5.0 and d["decode_tokens_per_s"] == 6.67
    assert d["accept_hist"] == {"1": 2, "4": 2} and d["x"] == 1 and "phase_s" not in d
