"""The measured busy time per stage counts every compute action a rank runs for it,
the vocabulary passes included (they are the output layer's work), and no transfer."""
from fxpipe.runtime.balance import BalanceMeter
from fxpipe.schedules.actions import Action, ActionKind as K


def _events(spans):
    t, out = 0.0, []
    for stage, kind, ms in spans:
        out.append((Action(stage, kind, 0), t, t + ms / 1e3))
        t += ms / 1e3
    return out


def test_busy_sums_compute_and_vocabulary_passes_not_transfers():
    meter = BalanceMeter()
    meter.add(_events([(1, K.F, 3.0), (1, K.BCAST_H, 50.0), (1, K.S, 2.0), (1, K.ALLREDUCE_S, 40.0),
                       (1, K.T, 4.0), (1, K.REDUCE_G, 30.0), (1, K.B, 5.0), (1, K.SEND_B, 20.0)]))
    summary = meter.summary()
    assert abs(summary["busy"][1] - 14.0) < 1e-6  # F + S + T + B
    assert set(summary["durations"]) == {(1, "F"), (1, "B")}  # per-microbatch F/B rows: the stage's own
