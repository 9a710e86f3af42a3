"""Generators: exact orders on small cases, an independent Megatron
reconstruction, the group rule for m % p != 0, input errors, the registry."""
import pytest

from fxpipe.schedules import SCHEDULES, ActionKind, generate, get_spec, schedule_names
from fxpipe.schedules.generators.interleaved import microbatch_groups


def text(sched):
    return [" ".join(str(a) for a in rank) for rank in sched.actions]


def test_registry_names():
    assert schedule_names() == ["gpipe", "1f1b", "interleaved", "zb-h1", "zb-v"]
    assert get_spec("ZB-V").name == "zb-v"  # case-insensitive


def test_unknown_name_lists_valid_names():
    with pytest.raises(ValueError, match=r"unknown schedule 'pipedream'.*gpipe, 1f1b, interleaved, zb-h1, zb-v"):
        generate("pipedream", 4, 8)


def test_gpipe_order():
    assert text(generate("gpipe", 2, 3)) == ["0F0 0F1 0F2 0B0 0B1 0B2", "1F0 1F1 1F2 1B0 1B1 1B2"]


def test_1f1b_order():
    # rank r: warmup min(p-r-1, m) forwards, steady F/B pairs, cooldown.
    assert text(generate("1f1b", 3, 4)) == [
        "0F0 0F1 0F2 0B0 0F3 0B1 0B2 0B3",
        "1F0 1F1 1B0 1F2 1B1 1F3 1B2 1B3",
        "2F0 2B0 2F1 2B1 2F2 2B2 2F3 2B3",
    ]
    # m < p: the warmup covers every microbatch.
    assert text(generate("1f1b", 4, 2))[0] == "0F0 0F1 0B0 0B1"


def test_zb_h1_order():
    # Rank r holds back its r most recent W's; rank 0 runs each W at once.
    assert text(generate("zb-h1", 3, 4)) == [
        "0F0 0F1 0F2 0I0 0W0 0F3 0I1 0W1 0I2 0W2 0I3 0W3",
        "1F0 1F1 1I0 1F2 1I1 1W0 1F3 1I2 1W1 1I3 1W2 1W3",
        "2F0 2I0 2F1 2I1 2F2 2I2 2W0 2F3 2I3 2W1 2W2 2W3",
    ]


def megatron_interleaved(p, m, v):
    """Independent reconstruction from the statement of Megatron's
    rule (m % p == 0): forward unit k runs chunk (k mod pv) div p on
    microbatch (k div pv)*p + k mod p; backward units reverse the chunks;
    warmup (p-r-1)*2 + (v-1)*p, capped at m*v."""
    total = m * v
    out = []
    for r in range(p):
        def unit(k, backward):
            chunk = (k % (p * v)) // p
            if backward:
                chunk = v - 1 - chunk
            mb = (k // (p * v)) * p + k % p
            return f"{chunk * p + r}{'B' if backward else 'F'}{mb}"
        warmup = min((p - r - 1) * 2 + (v - 1) * p, total)
        ops = [unit(k, False) for k in range(warmup)]
        for k in range(total - warmup):
            ops += [unit(k + warmup, False), unit(k, True)]
        ops += [unit(k, True) for k in range(total - warmup, total)]
        out.append(" ".join(ops))
    return out


@pytest.mark.parametrize("p, m, v", [(2, 4, 2), (4, 8, 2), (4, 4, 3), (3, 9, 4), (8, 16, 2)])
def test_interleaved_matches_megatron_when_m_divisible_by_p(p, m, v):
    assert text(generate("interleaved", p, m, v)) == megatron_interleaved(p, m, v)


def test_interleaved_with_one_chunk_is_1f1b():
    for p, m in [(1, 3), (4, 8), (4, 3), (5, 7)]:
        assert generate("interleaved", p, m, 1).actions == generate("1f1b", p, m).actions


@pytest.mark.parametrize(
    "p, m, sizes",
    [(4, 8, [4, 4]), (4, 10, [5, 5]), (4, 11, [6, 5]), (4, 13, [5, 4, 4]), (4, 3, [3]), (1, 5, [1] * 5), (8, 64, [8] * 8)],
)
def test_microbatch_groups(p, m, sizes):
    groups = microbatch_groups(p, m)
    assert [len(g) for g in groups] == sizes
    assert [j for g in groups for j in g] == list(range(m))  # consecutive, in order
    assert all(len(g) >= p for g in groups) or m < p


def test_interleaved_uneven_groups_run_each_chunk_over_a_whole_group():
    # p=4, m=10 -> groups [0..4], [5..9]: forwards of chunk 0 on mb 0..4, then chunk 1 on 0..4.
    s = generate("interleaved", 4, 10, 2)
    forwards = [str(a) for a in s.actions[3] if a.kind is ActionKind.F]
    assert forwards[:10] == ["3F0", "3F1", "3F2", "3F3", "3F4", "7F0", "7F1", "7F2", "7F3", "7F4"]


def test_zb_v_shape():
    s = generate("zb-v", 3, 6)
    assert s.num_chunks == 2
    assert s.stages_of_rank(0) == (0, 5) and s.stages_of_rank(2) == (2, 3)
    # rank 0 starts with 2(p-r)-1 = 5 forwards of its first stage.
    assert [str(a) for a in s.actions[0][:6]] == ["0F0", "0F1", "0F2", "0F3", "0F4", "5F0"]
    kinds = {a.kind for rank in s.actions for a in rank}
    assert kinds == {ActionKind.F, ActionKind.I, ActionKind.W}


def test_zb_v_small_m_drops_padding_microbatches():
    s = generate("zb-v", 4, 2)  # built for 2p-1 = 7 microbatches, keeps 0 and 1
    assert {a.microbatch for rank in s.actions for a in rank} == {0, 1}
    assert sum(map(len, s.actions)) == 3 * 2 * 8  # F, I, W x m x stages


def test_default_chunks():
    assert generate("interleaved", 4, 8).num_chunks == 2
    assert generate("zb-v", 4, 8).num_chunks == 2
    assert generate("1f1b", 4, 8).num_chunks == 1


@pytest.mark.parametrize("name", list(SCHEDULES))
def test_rejects_bad_sizes(name):
    with pytest.raises(ValueError, match=r"num_microbatches must be >= 1, got 0; pass --microbatches"):
        generate(name, 4, 0)
    with pytest.raises(ValueError, match=r"num_ranks \(pp size\) must be >= 1, got -2"):
        generate(name, -2, 4)
    with pytest.raises(ValueError, match=r"num_chunks .* must be >= 1, got 0"):
        generate(name, 4, 4, 0)
    with pytest.raises(TypeError, match="must be an int"):
        generate(name, 4.0, 4)


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "zb-h1"])
def test_single_chunk_schedules_reject_chunks(name):
    with pytest.raises(ValueError, match=r"got num_chunks=2, .* num_chunks in \[1\]; use 'interleaved'"):
        generate(name, 4, 8, 2)


def test_v_shape_requires_two_chunks():
    with pytest.raises(ValueError, match=r"zb-v: got num_chunks=3, .*pass num_chunks=2"):
        generate("zb-v", 4, 8, 3)


def test_generators_are_compute_only():
    for name in SCHEDULES:
        s = generate(name, 3, 5)
        assert not s.is_lowered
        assert s.splits_backward == (name in ("zb-h1", "zb-v"))


def test_docstring_examples():
    import doctest

    from fxpipe.schedules import registry

    assert doctest.testmod(registry).failed == 0
