"""Hardware presets, collectives and profiles."""
import json

import pytest

from fxpipe.base.hardware import A100, CPU, H100, PRESETS, V100, Collective, Hardware, get_hardware


def test_presets_and_rates():
    assert set(PRESETS) >= {"a100", "v100", "h100", "cpu"}
    assert A100.matmul_flops == pytest.approx(312e12 * A100.matmul_efficiency)
    assert A100.memory_bytes == 80 * 2**30 and V100.memory_bytes == 32 * 2**30
    assert H100.peak_flops > A100.peak_flops > V100.peak_flops
    assert A100.p2p_bw == A100.inter_node.p2p_bw  # the partition pass's inter-stage link


def test_ring_collectives():
    S, n = 1e9, 8
    ar = A100.collective_s(Collective.ALL_REDUCE, S, n, n)
    link = A100.intra_node
    assert ar == pytest.approx(2 * (n - 1) / n * S / link.collective_bw + 2 * (n - 1) * link.collective_latency)
    ag = A100.collective_s(Collective.ALL_GATHER, S, n, n)
    rs = A100.collective_s(Collective.REDUCE_SCATTER, S, n, n)
    assert ag + rs == pytest.approx(ar)
    # broadcast and reduce: a pipelined ring moves the whole tensor over each link once
    for kind in (Collective.BROADCAST, Collective.REDUCE):
        assert A100.collective_s(kind, S, n, n) == pytest.approx(S / link.collective_bw + (n - 1) * link.collective_latency)
    assert A100.collective_s(Collective.ALL_REDUCE, S, 1, 1) == 0.0
    # a group with one member per node rides one NIC; with 8 per node, eight
    one = A100.collective_s(Collective.ALL_REDUCE, S, 16, 1)
    eight = A100.collective_s(Collective.ALL_REDUCE, S, 16, 8)
    assert one == pytest.approx(2 * 15 / 16 * S / A100.inter_node.collective_bw + 30 * A100.inter_node.collective_latency)
    assert eight < one / 5


def test_members_per_node_follow_megatron_layout():
    assert A100.members_per_node(8, 1) == 8      # tp=8 fills a node
    assert A100.members_per_node(32, 8) == 1     # dp group strided by tp=8
    assert A100.members_per_node(32, 2) == 4     # dp with tp=2: 4 replicas per node
    assert A100.members_per_node(16, 1) == 8     # tp=16 spans two nodes


def test_gemm_roofline():
    big = A100.gemm_s(8192, 8192, 8192)
    assert big == pytest.approx(2 * 8192 ** 3 / A100.matmul_flops + A100.op_overhead_s)
    thin = A100.gemm_s(2048, 2048, 16, batch=64)  # K=16: memory bound
    assert thin > 2 * 2048 * 2048 * 16 * 64 / A100.matmul_flops * 2


def test_profile_round_trip(tmp_path):
    path = tmp_path / "hw.json"
    CPU.save(str(path), measurements={"note": 1})
    assert json.loads(path.read_text())["measurements"] == {"note": 1}
    assert Hardware.load(str(path)) == CPU
    assert get_hardware(str(path)) == CPU
    with pytest.raises(ValueError, match="a100"):
        get_hardware("tpu-v9")
    with pytest.raises(ValueError, match="matmul_efficiency"):
        Hardware(**{**CPU.__dict__, "matmul_efficiency": 1.5})
