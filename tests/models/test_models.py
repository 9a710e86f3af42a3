from fxpipe.models import GPT_CONFIGS, build_workload


def test_gpt_parameter_formula():
    """l(12h²+13h) + Vh + sh + 2h with the LM head tied (Narayanan et al. SC21, appendix)."""
    for name in ("gpt-tiny", "gpt-small"):
        w = build_workload(name)
        assert sum(p.numel() for p in w.model.parameters()) == GPT_CONFIGS[name].num_params


def test_gpt3_175b_shape():
    assert abs(GPT_CONFIGS["gpt3-175b"].num_params / 1e9 - 174.6) < 0.1
