"""SamplingParams validation and workers.sampling (greedy, temperature, top-k, top-p, seeds)."""

import dataclasses
import math
import pickle
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler.types import MAX_NEW_TOKENS, MAX_STOP_LEN, MAX_STOP_STRINGS, InvalidRequest, SamplingParams
from workers.sampling import make_generator, processed_probs, sample

# ---------------------------------------------------------------- validation

BAD = [
    # (kwargs, field, fragment of the allowed range)
    (dict(temperature=-0.1), "temperature", ">= 0"),
    (dict(temperature=float("nan")), "temperature", ">= 0"),
    (dict(temperature=float("inf")), "temperature", ">= 0"),
    (dict(temperature="0.5"), "temperature", ">= 0"),
    (dict(temperature=True), "temperature", ">= 0"),
    (dict(temperature=None), "temperature", ">= 0"),
    (dict(top_p=0.0), "top_p", "(0, 1]"),
    (dict(top_p=-0.5), "top_p", "(0, 1]"),
    (dict(top_p=1.5), "top_p", "(0, 1]"),
    (dict(top_p=float("nan")), "top_p", "(0, 1]"),
    (dict(top_p="1"), "top_p", "(0, 1]"),
    (dict(top_p=True), "top_p", "(0, 1]"),
    (dict(top_k=-1), "top_k", ">= 0"),
    (dict(top_k=2.0), "top_k", ">= 0"),
    (dict(top_k=True), "top_k", ">= 0"),
    (dict(top_k="5"), "top_k", ">= 0"),
    (dict(max_new_tokens=0), "max_new_tokens", f"between 1 and {MAX_NEW_TOKENS}"),
    (dict(max_new_tokens=-3), "max_new_tokens", f"between 1 and {MAX_NEW_TOKENS}"),
    (dict(max_new_tokens=MAX_NEW_TOKENS + 1), "max_new_tokens", f"between 1 and {MAX_NEW_TOKENS}"),
    (dict(max_new_tokens=True), "max_new_tokens", f"between 1 and {MAX_NEW_TOKENS}"),
    (dict(max_new_tokens=4.0), "max_new_tokens", f"between 1 and {MAX_NEW_TOKENS}"),
    (dict(max_new_tokens="3"), "max_new_tokens", f"between 1 and {MAX_NEW_TOKENS}"),
    (dict(max_new_tokens=None), "max_new_tokens", f"between 1 and {MAX_NEW_TOKENS}"),
    (dict(stop="abc"), "stop", f"at most {MAX_STOP_STRINGS}"),
    (dict(stop=None), "stop", f"at most {MAX_STOP_STRINGS}"),
    (dict(stop=["a"] * (MAX_STOP_STRINGS + 1)), "stop", f"at most {MAX_STOP_STRINGS}"),
    (dict(stop=[""]), "stop", f"1 to {MAX_STOP_LEN}"),
    (dict(stop=["ok", "x" * (MAX_STOP_LEN + 1)]), "stop", f"1 to {MAX_STOP_LEN}"),
    (dict(stop=[1]), "stop", f"1 to {MAX_STOP_LEN}"),
    (dict(seed=-1), "seed", "[0, 2**63)"),
    (dict(seed=2**63), "seed", "[0, 2**63)"),
    (dict(seed=1.5), "seed", "[0, 2**63)"),
    (dict(seed=True), "seed", "[0, 2**63)"),
    (dict(seed="7"), "seed", "[0, 2**63)"),
    (dict(ignore_eos=1), "ignore_eos", "true or false"),
    (dict(ignore_eos="yes"), "ignore_eos", "true or false"),
    (dict(ignore_eos=None), "ignore_eos", "true or false"),
]


@pytest.mark.parametrize("kwargs,field,allowed", BAD, ids=[f"{f}={kw[f]!r}"[:40] for kw, f, _ in BAD])
def test_invalid_field_is_named(kwargs, field, allowed):
    with pytest.raises(InvalidRequest) as ei:
        SamplingParams(**kwargs)
    err = ei.value
    assert isinstance(err, ValueError)
    assert err.field == field
    msg = str(err)
    assert msg.startswith(field), msg
    assert allowed in msg, msg
    assert "got" in msg, msg


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(max_new_tokens=0), "max_new_tokens must be between 1 and 8192, got 0"),
        (dict(temperature=float("nan")), "temperature must be a finite number >= 0, got nan"),
        (dict(top_p=1.5), "top_p must be in (0, 1], got 1.5"),
        (dict(top_k=-1), "top_k must be >= 0 (0 disables it), got -1"),
    ],
)
def test_exact_messages(kwargs, message):
    with pytest.raises(InvalidRequest) as ei:
        SamplingParams(**kwargs)
    assert str(ei.value) == message


def test_bad_type_message_names_the_type():
    with pytest.raises(InvalidRequest) as ei:
        SamplingParams(temperature="hot")
    assert "'hot' (str)" in str(ei.value)
    with pytest.raises(InvalidRequest) as ei:
        SamplingParams(stop=["x" * 10_000])
    assert len(str(ei.value)) < 200 and "length 10000" in str(ei.value)


def test_bounds_accepted_and_normalized():
    p = SamplingParams(
        temperature=2,
        top_p=1,
        top_k=1,
        max_new_tokens=MAX_NEW_TOKENS,
        stop=tuple("x" * MAX_STOP_LEN for _ in range(MAX_STOP_STRINGS)),
        seed=2**63 - 1,
        ignore_eos=True,
    )
    assert type(p.temperature) is float and type(p.top_p) is float
    assert isinstance(p.stop, list) and len(p.stop) == MAX_STOP_STRINGS
    assert p.validate() is p
    SamplingParams(temperature=0.0, top_p=1e-9, top_k=0, max_new_tokens=1, stop=[], seed=0)
    d = SamplingParams()
    assert (d.temperature, d.top_p, d.top_k, d.max_new_tokens, d.stop, d.seed, d.ignore_eos) == (
        0.0, 1.0, 0, 32, [], None, False,
    )


def test_frozen_and_replace_revalidates():
    stops = ["a"]
    p = SamplingParams(stop=stops)
    stops.append("")  # caller's list is copied, not aliased
    assert p.stop == ["a"]
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.max_new_tokens = 0
    assert dataclasses.replace(p, max_new_tokens=5).max_new_tokens == 5
    with pytest.raises(InvalidRequest):
        dataclasses.replace(p, max_new_tokens=0)


def test_invalid_request_pickles_with_field():
    try:
        SamplingParams(top_p=2.0)
    except InvalidRequest as e:
        back = pickle.loads(pickle.dumps(e))
        assert back.field == "top_p" and str(back) == str(e)


def test_types_module_does_not_import_torch():
    code = "import sys, scheduler.types; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


@settings(max_examples=100, deadline=None)
@given(t=st.floats(allow_nan=True, allow_infinity=True), p=st.floats(allow_nan=True), k=st.integers(-5, 10**6))
def test_fuzz_numeric_fields(t, p, k):
    ok = math.isfinite(t) and t >= 0 and 0 < p <= 1 and k >= 0
    try:
        SamplingParams(temperature=t, top_p=p, top_k=k)
    except InvalidRequest as e:
        assert not ok and e.field in ("temperature", "top_p", "top_k") and e.field in str(e)
    else:
        assert ok


# ---------------------------------------------------------------- processed_probs


def _reference_probs(row, temperature, top_k, top_p):
    """Plain-Python float64 reference: rank (ties -> lower id), top-k, renormalize, top-p."""
    vals = [v / temperature for v in row.tolist()]
    ranked = sorted(range(len(vals)), key=lambda i: (-vals[i], i))
    if top_k > 0:
        ranked = ranked[:top_k]
    m = max(vals[i] for i in ranked)
    w = {i: math.exp(vals[i] - m) for i in ranked}
    z = sum(w.values())
    if top_p >= 1:
        top_p = math.inf  # disabled: keep all (float64 mass may round to 1 before the tail)
    kept, mass = [], 0.0
    for i in ranked:
        kept.append(i)
        mass += w[i] / z
        if mass >= top_p:
            break
    z2 = sum(w[i] for i in kept)
    out = [0.0] * len(vals)
    for i in kept:
        out[i] = w[i] / z2
    return torch.tensor(out, dtype=torch.float64)


@pytest.mark.parametrize("temperature", [0.3, 1.0, 2.5])
@pytest.mark.parametrize("top_k,top_p", [(0, 1.0), (1, 1.0), (5, 1.0), (0, 0.9), (0, 0.3), (10, 0.7), (64, 0.95)])
def test_processed_probs_matches_reference(temperature, top_k, top_p):
    g = torch.Generator().manual_seed(1234)
    logits = torch.randn(6, 64, generator=g) * 3
    probs = processed_probs(logits, temperature, top_k, top_p)
    assert probs.dtype == torch.float32 and probs.shape == logits.shape
    assert torch.allclose(probs.sum(-1), torch.ones(6), atol=1e-5, rtol=0)
    for r in range(logits.shape[0]):
        ref = _reference_probs(logits[r], temperature, top_k, top_p)
        assert torch.equal(probs[r] > 0, ref > 0), (r, probs[r], ref)
        assert torch.allclose(probs[r].double(), ref, atol=1e-5, rtol=1e-4), (probs[r], ref)
        if top_k:
            assert int((probs[r] > 0).sum()) <= top_k


def test_processed_probs_top_p_exact_sets():
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()
    support = lambda top_p: (processed_probs(logits, 1.0, 0, top_p)[0] > 0).nonzero().flatten().tolist()
    assert support(0.45) == [0]
    assert support(0.75) == [0, 1]
    assert support(0.85) == [0, 1, 2]
    assert support(0.99) == [0, 1, 2, 3]
    assert torch.allclose(processed_probs(logits, 1.0, 0, 0.75)[0], torch.tensor([0.625, 0.375, 0, 0]))
    # top-k applies first, then top-p on the renormalized top-k mass.
    assert processed_probs(logits, 1.0, 2, 0.6)[0].tolist() == [1.0, 0.0, 0.0, 0.0]


def test_processed_probs_edge_cases():
    with pytest.raises(ValueError):
        processed_probs(torch.zeros(1, 4), 0.0, 0, 1.0)
    # A tiny temperature must not produce NaN (inf - inf); it collapses onto the argmax.
    logits = torch.tensor([[1e30, 3.0, -1e30, 2.9]])
    assert processed_probs(logits, 1e-30, 0, 1.0).tolist() == [[1.0, 0.0, 0.0, 0.0]]
    # Masked (-inf) tokens stay at zero; ties are kept in order (lower id first).
    logits = torch.tensor([[float("-inf"), 2.0, 2.0, 0.0]])
    assert processed_probs(logits, 1.0, 1, 1.0).tolist() == [[0.0, 1.0, 0.0, 0.0]]
    p = processed_probs(logits, 1.0, 0, 1.0)
    assert p[0, 0] == 0 and p[0, 1] == p[0, 2] and abs(float(p.sum()) - 1) < 1e-6
    # bf16 input is computed in fp32.
    assert processed_probs(torch.randn(2, 8).bfloat16(), 0.7, 3, 0.9).dtype == torch.float32


# ---------------------------------------------------------------- sample


def _params(n, **kw):
    return [SamplingParams(**kw) for _ in range(n)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_greedy_is_argmax_and_consumes_no_randomness(dtype):
    logits = torch.randn(16, 100, generator=torch.Generator().manual_seed(0)).to(dtype)
    gens = [make_generator(i, "cpu") for i in range(16)]
    before = [g.get_state() for g in gens]
    out = sample(logits, _params(16), gens)
    assert out.dtype == torch.int64 and out.shape == (16,)
    assert torch.equal(out, logits.float().argmax(-1))
    assert all(torch.equal(b, g.get_state()) for b, g in zip(before, gens))


def test_mixed_batch_greedy_rows_untouched():
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(1))
    params = [SamplingParams(temperature=1.0 if i % 2 else 0.0, seed=i) for i in range(6)]
    gens = [make_generator(p.seed, "cpu") for p in params]
    before = [g.get_state() for g in gens]
    out = sample(logits, params, gens)
    assert torch.equal(out[0::2], logits[0::2].argmax(-1))
    for i in range(6):
        assert torch.equal(before[i], gens[i].get_state()) == (i % 2 == 0)


@pytest.mark.parametrize("kw", [dict(top_k=1), dict(top_p=1e-6), dict(top_k=1, top_p=0.5)])
def test_degenerate_sampling_equals_greedy(kw):
    logits = torch.randn(64, 200, generator=torch.Generator().manual_seed(2)) * 2
    logits[0, :] = 0.0  # an all-tie row: both pick token 0
    logits[1, 5] = logits[1, 7] = logits[1].max() + 1  # a tie at the top: both pick the lower id
    gens = [make_generator(i, "cpu") for i in range(64)]
    out = sample(logits, _params(64, temperature=1.3, **kw), gens)
    assert torch.equal(out, logits.argmax(-1))
    assert out[0] == 0 and out[1] == 5


def test_make_generator():
    assert make_generator(None, "cpu") is None
    g = make_generator(2**63 - 1, torch.device("cpu"))
    assert isinstance(g, torch.Generator) and g.device.type == "cpu"


def _run_steps(seed_rows, batch_for_step, steps=25):
    """Sample `steps` times; returns {row_name: [tokens]} for the rows named in seed_rows."""
    got = {name: [] for name in seed_rows}
    gens = {name: make_generator(seed, "cpu") for name, seed in seed_rows.items()}
    for t in range(steps):
        names, logits, params = batch_for_step(t)
        out = sample(logits, params, [gens.get(n) for n in names])
        for n, tok in zip(names, out.tolist()):
            if n in got:
                got[n].append(tok)
    return got


def _row(name, t, vocab=300):
    g = torch.Generator().manual_seed(hash((name, t)) % 2**31)
    return torch.randn(vocab, generator=g) * 2


def test_seed_reproduces_and_is_independent_of_batch():
    pa = SamplingParams(temperature=0.9, top_k=40, top_p=0.95, seed=7)

    def alone(t):
        return ["a"], _row("a", t).unsqueeze(0), [pa]

    def crowded(t):
        names = ["g", "b", "a", "u"][t % 4 :] + ["g", "b", "a", "u"][: t % 4]  # position of "a" moves
        ps = {
            "g": SamplingParams(),
            "b": SamplingParams(temperature=1.5, seed=9),
            "a": pa,
            "u": SamplingParams(temperature=1.0),  # unseeded: global RNG
        }
        return names, torch.stack([_row(n, t) for n in names]), [ps[n] for n in names]

    first = _run_steps({"a": 7}, alone)["a"]
    assert _run_steps({"a": 7}, alone)["a"] == first
    assert _run_steps({"a": 7, "b": 9}, crowded)["a"] == first
    assert _run_steps({"a": 8}, alone)["a"] != first  # another seed, other draws
    assert len(set(first)) > 5  # it really sampled


def test_sample_rejects_mismatched_inputs():
    with pytest.raises(ValueError):
        sample(torch.zeros(2, 5), _params(1), [None])
    with pytest.raises(ValueError):
        sample(torch.zeros(5), _params(1), [None])


@pytest.mark.parametrize("top_k,top_p", [(4, 1.0), (0, 0.8)])
def test_empirical_distribution(top_k, top_p):
    """Draw many tokens via sample() and compare frequencies with a float64 reference (chi-square)."""
    logits = torch.tensor([2.0, 1.5, 1.2, 0.4, 0.0, -0.3, -1.0, -2.0])
    temperature = 0.6
    expected = _reference_probs(logits, temperature, top_k, top_p)
    n = 4000
    gen = make_generator(2024, "cpu")
    out = sample(logits.expand(n, -1), _params(n, temperature=temperature, top_k=top_k, top_p=top_p), [gen] * n)
    counts = torch.bincount(out, minlength=logits.numel()).double()
    support = expected > 0
    assert counts[~support].sum() == 0, counts  # nothing outside top-k / top-p, ever
    exp_counts = expected[support] * n
    chi2 = float(((counts[support] - exp_counts) ** 2 / exp_counts).sum())
    dof = int(support.sum()) - 1
    assert dof <= 4
    # 99.99th percentile of chi-square with 4 degrees of freedom is 23.5 (fixed seed: no flakes).
    assert chi2 < 25, (chi2, counts, exp_counts)
    # The check has power: the same draws are rejected against the temperature-1 distribution.
    wrong = _reference_probs(logits, 1.0, top_k, top_p)[support] * n
    assert float(((counts[support] - wrong) ** 2 / wrong).sum()) > 25
