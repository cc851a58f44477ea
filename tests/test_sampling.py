"""SamplingParams validation and the token choice: greedy, temperature, top-k, top-p, seeds."""
import dataclasses
import math
import re
from collections import Counter

import pytest
import torch

from dsv2_lib.engine.sampling import MIN_TEMPERATURE, SamplingParams, filter_logits, sample

CPU = torch.device("cpu")


def draws(logits: torch.Tensor, params: SamplingParams, n: int) -> list[int]:
    """``n`` tokens sampled from one row of logits with the request's own seeded generator."""
    g = params.generator(CPU)
    return [sample(logits, params, g) for _ in range(n)]


def support(logits: torch.Tensor, params: SamplingParams) -> set[int]:
    """The tokens ``filter_logits`` keeps (finite logits)."""
    return set(torch.isfinite(filter_logits(logits, params)).nonzero().flatten().tolist())


def log_probs(*p: float) -> torch.Tensor:
    return torch.tensor(p, dtype=torch.float64).log().float()


# ---- validation ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "field, value",
    [
        ("max_tokens", 0),
        ("max_tokens", -3),
        ("max_tokens", 2.0),
        ("max_tokens", True),  # a bool is not a count, though Python says it is an int
        ("max_tokens", None),
        ("temperature", -0.5),
        ("temperature", float("nan")),
        ("temperature", float("inf")),
        ("temperature", "0.7"),
        ("temperature", None),
        ("temperature", True),
        ("top_p", True),
        ("top_k", -1),
        ("top_k", 2.5),
        ("top_k", True),
        ("top_p", 0),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_p", -0.1),
        ("top_p", float("nan")),
        ("top_p", "0.9"),
        ("seed", 1.5),
        ("seed", "42"),
        ("seed", True),
        ("seed", -1),
        ("seed", 2**64),  # torch's generator takes 64 bits; this failed mid-run, aborting the whole batch
        ("temperature", 1e-40),  # logits / 1e-40 overflow float32 to inf and the softmax to NaN
        ("temperature", 5e-5),
        ("ignore_eos", "no"),  # a non-empty string is truthy: "no" would have meant yes
        ("ignore_eos", 1),
        ("stop_token_ids", [-1]),
        ("stop_token_ids", [3, -2]),
        ("stop_token_ids", [1.0]),
        ("stop_token_ids", [True]),
        ("stop_token_ids", ["7"]),
        ("stop_token_ids", 7),  # one id, not a sequence of them
        ("stop_token_ids", None),
    ],
)
def test_invalid_params_name_the_field(field, value):
    with pytest.raises(ValueError, match=rf"SamplingParams\.{field} must be .*, got {re.escape(repr(value))}"):
        SamplingParams(**{field: value})



@pytest.mark.parametrize(
    "kw",
    [
        dict(max_tokens=1),
        dict(temperature=0),
        dict(temperature=0.0),
        dict(temperature=2),
        dict(top_k=0),
        dict(top_k=1),
        dict(top_p=1),
        dict(top_p=1e-9),
        dict(seed=0),
        dict(seed=2**64 - 1),
        dict(temperature=1e-4),
        dict(stop_token_ids=[0, 5]),
        dict(stop_token_ids=()),
        dict(ignore_eos=True),
    ],
)
def test_valid_params_are_accepted(kw):
    SamplingParams(**kw)


def test_params_are_frozen_and_stop_ids_a_tuple():
    p = SamplingParams(stop_token_ids=[5, 9])
    assert p.stop_token_ids == (5, 9)
    hash(p)  # usable as a dict key: immutable
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.max_tokens = 3
    assert SamplingParams().max_tokens >= 1 and SamplingParams().top_p == 1 and SamplingParams().top_k == 0


def test_stop_ids_from_any_iterable():
    assert SamplingParams(stop_token_ids=(t for t in [4, 2])).stop_token_ids == (4, 2)  # a generator, read once
    assert SamplingParams(stop_token_ids=range(3)).stop_token_ids == (0, 1, 2)


def test_greedy_needs_no_generator():
    assert SamplingParams(temperature=0).generator(CPU) is None
    assert isinstance(SamplingParams(temperature=0.5).generator(CPU), torch.Generator)


# ---- greedy -------------------------------------------------------------------------------------


def test_greedy_is_argmax():
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        logits = torch.randn(1000, generator=g) * 3
        best = int(logits.argmax())
        assert sample(logits, SamplingParams(temperature=0), None) == best
        # top_k / top_p are irrelevant when greedy
        assert sample(logits, SamplingParams(temperature=0, top_k=50, top_p=0.1), None) == best
    # bf16 logits too
    logits = torch.tensor([0.0, 3.0, -1.0, 2.5], dtype=torch.bfloat16)
    assert sample(logits, SamplingParams(temperature=0), None) == 1


@pytest.mark.parametrize("temperature", [1e-3, 0.5, 1.0, 7.0, 1000.0])
def test_top_k_1_is_greedy_at_any_temperature(temperature):
    logits = torch.randn(300, generator=torch.Generator().manual_seed(1))
    params = SamplingParams(temperature=temperature, top_k=1, seed=3)
    assert set(draws(logits, params, 200)) == {int(logits.argmax())}
    assert support(logits, params) == {int(logits.argmax())}


# ---- top-k --------------------------------------------------------------------------------------


@pytest.mark.parametrize("k", [2, 3, 5])
def test_top_k_keeps_exactly_the_k_best(k):
    # a fairly flat distribution over 10 distinct logits, so every kept token shows up in the draws
    logits = torch.tensor([0.1, 0.9, 0.3, 0.0, 0.8, 0.5, 0.2, 0.7, 0.4, 0.6])
    best = set(logits.topk(k).indices.tolist())
    params = SamplingParams(top_k=k, seed=11)
    assert support(logits, params) == best
    assert set(draws(logits, params, 2000)) == best
    # larger than the vocabulary: no cut
    assert support(logits, SamplingParams(top_k=50)) == set(range(10))


def test_top_k_renormalises_over_the_kept_tokens():
    logits = log_probs(0.4, 0.3, 0.2, 0.1)
    probs = filter_logits(logits, SamplingParams(top_k=2)).softmax(-1)
    assert torch.allclose(probs, torch.tensor([4 / 7, 3 / 7, 0, 0]), atol=1e-6)


# ---- top-p --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "top_p, kept",
    [
        (0.3, {0}),
        (0.5, {0}),  # token 0 alone reaches 0.5
        (0.6, {0, 1}),
        (0.8, {0, 1}),  # 0.5 + 0.3 reaches 0.8 exactly: token 2 is not needed
        (0.81, {0, 1, 2}),
        (0.95, {0, 1, 2}),
        (0.96, {0, 1, 2, 3}),
        (1.0, {0, 1, 2, 3}),
    ],
)
def test_top_p_keeps_the_smallest_set_reaching_p(top_p, kept):
    # shuffled, so the cut must follow probability, not position
    order = [2, 0, 3, 1]  # position i holds the order[i]-th most likely token
    p = [0.5, 0.3, 0.15, 0.05]
    logits = log_probs(*[p[o] for o in order])
    want = {i for i, o in enumerate(order) if o in kept}
    params = SamplingParams(top_p=top_p, seed=5)
    assert support(logits, params) == want
    assert set(draws(logits, params, 1500)) == want


def test_top_p_always_keeps_the_most_likely_token():
    logits = log_probs(0.9, 0.05, 0.05)
    assert support(logits, SamplingParams(top_p=1e-6)) == {0}


def test_top_k_applies_before_top_p():
    """top-k first, then top-p on the renormalised survivors (transformers' and vLLM's order)."""
    logits = log_probs(0.4, 0.3, 0.2, 0.1)
    assert support(logits, SamplingParams(top_p=0.5)) == {0, 1}
    # after top_k=2 the survivors are 4/7 and 3/7: 4/7 alone reaches 0.5
    assert support(logits, SamplingParams(top_k=2, top_p=0.5)) == {0}
    assert support(logits, SamplingParams(top_k=3, top_p=0.99)) == {0, 1, 2}


def test_filter_logits_leaves_its_input_alone():
    logits = torch.randn(50, generator=torch.Generator().manual_seed(2))
    before = logits.clone()
    out = filter_logits(logits, SamplingParams(temperature=0.5, top_k=5, top_p=0.5))
    assert torch.equal(logits, before)
    assert out.dtype == torch.float32
    kept = torch.isfinite(out)
    assert torch.allclose(out[kept], logits[kept] / 0.5)


# ---- seeds --------------------------------------------------------------------------------------


def test_same_seed_same_tokens_different_seed_different_tokens():
    logits = torch.zeros(1000)  # uniform: 100 draws from 1000 tokens never coincide by chance
    a = draws(logits, SamplingParams(seed=42), 100)
    b = draws(logits, SamplingParams(seed=42), 100)
    c = draws(logits, SamplingParams(seed=43), 100)
    assert a == b
    assert a != c
    assert len(set(a)) > 50  # really random, not a constant


def test_no_seed_is_not_reproducible():
    logits = torch.zeros(1000)
    assert draws(logits, SamplingParams(seed=None), 50) != draws(logits, SamplingParams(seed=None), 50)


def test_seeded_sampling_ignores_the_global_rng():
    logits = torch.zeros(1000)
    torch.manual_seed(0)
    a = draws(logits, SamplingParams(seed=7), 30)
    torch.manual_seed(123)
    torch.rand(5)
    assert draws(logits, SamplingParams(seed=7), 30) == a


# ---- temperature --------------------------------------------------------------------------------


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_empirical_frequencies_follow_softmax_of_logits_over_t(temperature):
    logits = torch.tensor([1.0, 0.5, 0.0, -1.0, 2.0])
    n = 3000
    counts = Counter(draws(logits, SamplingParams(temperature=temperature, seed=17), n))
    p = (logits / temperature).softmax(-1).tolist()
    for token, prob in enumerate(p):
        sigma = math.sqrt(prob * (1 - prob) / n)
        assert abs(counts[token] / n - prob) < 4.5 * sigma + 1e-3, (token, counts[token] / n, prob)


def test_temperature_sharpens_and_flattens():
    logits = torch.tensor([2.0, 1.0, 0.0])
    n = 2000
    top = {t: Counter(draws(logits, SamplingParams(temperature=t, seed=1), n))[0] / n for t in (0.25, 1.0, 4.0)}
    assert top[0.25] > top[1.0] > top[4.0]
    assert top[0.25] > 0.95 and top[4.0] < 0.5
    # the filter divides logits by T
    assert torch.allclose(filter_logits(logits, SamplingParams(temperature=4.0)), logits / 4)


def test_sample_rows_picks_what_sample_picks_row_by_row():
    """Mixed greedy and sampled rows, ties included: the batched function draws exactly the tokens
    that sample() draws for each row alone, with fresh generators seeded alike."""
    from dsv2_lib.engine.sampling import sample, sample_rows

    torch.manual_seed(0)
    logits = torch.randn(6, 50)
    logits[1, [3, 7]] = 10.0  # a tie at the top of a greedy row: the lower id wins, both ways
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.0),
              SamplingParams(temperature=0.7, seed=1), SamplingParams(top_k=5, seed=2),
              SamplingParams(top_p=0.5, seed=3), SamplingParams(temperature=1.3, top_k=10, top_p=0.9, seed=4)]
    for step in range(3):
        want = [sample(row, p, p.generator(torch.device("cpu"))) for row, p in zip(logits, params)]
        got = sample_rows(logits, params, [p.generator(torch.device("cpu")) for p in params])
        assert got == want and (step > 0 or got[1] == 3)
        logits = torch.randn(6, 50)


@pytest.mark.parametrize("seed", [0, 2**63, 2**64 - 1])
def test_every_accepted_seed_seeds_a_generator(seed):
    """The range SamplingParams accepts is the range torch's generator takes (no failure mid-run)."""
    g = SamplingParams(temperature=1.0, seed=seed).generator(torch.device("cpu"))
    assert g.initial_seed() == seed


def test_the_smallest_accepted_temperature_still_samples_a_distribution():
    logits = torch.tensor([[80.0, 79.0, -80.0]])  # as large as real logits get
    scaled = logits / MIN_TEMPERATURE
    assert torch.isfinite(torch.softmax(scaled, dim=-1)).all()
